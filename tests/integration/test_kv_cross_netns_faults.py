"""`kill -9` mid-transfer across a real network interface: the prefill side exports over UCX (the workers'
default config) in one network namespace, the decode side pulls in another, joined by a veth pair. Each
side is killed once its bytes are on the wire (the veth's counter says so); the other side fails that
transfer cleanly, if it was in it, and goes on serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("ucxx")

LAYOUT = "llama-125m"
SIZE_MIB = 512


@pytest.fixture
def link():
    from pdserve.bench.netns import NetnsUnavailable, veth_pair

    try:
        with veth_pair() as pair:
            yield pair
    except NetnsUnavailable as exc:
        pytest.skip(f"no network namespaces here: {exc}")


def _num_blocks() -> int:
    from pdserve.bench.transfer import LAYOUTS

    return SIZE_MIB * (1 << 20) // LAYOUTS[LAYOUT].block_nbytes


def _exporter(link, num_blocks: int, num_leases: int) -> tuple[subprocess.Popen, list[dict]]:
    from pdserve.bench.netns import _in_ns

    proc = _in_ns(link.prefill_ns, "ucx-export", link.prefill_address, LAYOUT, str(num_blocks), str(num_leases),
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line, "the exporter did not start"
    return proc, json.loads(line)


def _puller(link, num_blocks: int, params: list[dict]) -> subprocess.Popen:
    from pdserve.bench.netns import _in_ns

    proc = _in_ns(link.decode_ns, "ucx-pull-each", LAYOUT, str(num_blocks), stdin=subprocess.PIPE,
                  stdout=subprocess.PIPE)
    proc.stdin.write(json.dumps(params) + "\n")
    proc.stdin.flush()
    return proc


def _kill_when_on_the_wire(link, victim: subprocess.Popen, nbytes: int) -> None:
    """SIGKILL to `victim`'s Python (under `ip netns exec`) once a tenth of `nbytes` crossed the veth."""
    start = link.tx_bytes()
    deadline = time.monotonic() + 120
    while link.tx_bytes() - start < nbytes // 10:
        assert time.monotonic() < deadline, "no bytes crossed the link"
        time.sleep(0.005)
    assert link.tx_bytes() - start < nbytes, "the transfer ended before the kill"
    os.kill(victim.pid, signal.SIGKILL)  # `ip netns exec` execs the command: this pid is the Python process
    victim.wait(30)


def _stop(proc: subprocess.Popen) -> None:
    from pdserve.bench.netns import end_server

    if proc.poll() is None:
        end_server(proc)


def test_an_exporter_killed_mid_pull_fails_that_pull_and_the_puller_pulls_the_next(link):
    num_blocks = _num_blocks()
    doomed, doomed_params = _exporter(link, num_blocks, 1)
    alive, alive_params = _exporter(link, num_blocks, 1)
    puller = _puller(link, num_blocks, doomed_params + alive_params)
    try:
        assert puller.stdout.readline().strip() == "pulling 0"
        _kill_when_on_the_wire(link, doomed, SIZE_MIB << 20)
        assert puller.stdout.readline().strip() == "pulling 1"
        outcomes = json.loads(puller.stdout.readline())
        assert puller.wait(60) == 0
    finally:
        for proc in (doomed, alive, puller):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outcomes[0] == {"ok": False, "error": "KVTransferError"}
    assert outcomes[1] == {"ok": True, "intact": True}


def test_a_puller_killed_mid_pull_leaves_the_exporter_serving_the_next_puller(link):
    num_blocks = _num_blocks()
    exporter, params = _exporter(link, num_blocks, 2)
    try:
        doomed = _puller(link, num_blocks, params[:1])
        assert doomed.stdout.readline().strip() == "pulling 0"
        _kill_when_on_the_wire(link, doomed, SIZE_MIB << 20)
        assert exporter.poll() is None, "the exporter died with its puller"
        survivor = _puller(link, num_blocks, params[1:])
        assert survivor.stdout.readline().strip() == "pulling 0"
        assert json.loads(survivor.stdout.readline()) == [{"ok": True, "intact": True}]
        assert survivor.wait(60) == 0 and exporter.poll() is None
    finally:
        _stop(exporter)
