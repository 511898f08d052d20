"""KV transfer between two Linux network namespaces joined by a veth pair: the bytes cross a real network
interface (the kernel's veth driver and TCP stack on both sides), not loopback.

    python -m pdserve.bench.netns --json [--sizes-mib 16,64,256] [--repeats 3]

Per size, in the same run and taken in turn: UCX (the workers' default config, endpoint error handling on)
pulling one handoff from an exporter in the prefill namespace into a pool in the decode namespace; a raw
TCP stream of as many bytes, held in memory like the pool's, between the same namespaces (the wire's limit
here); and one ucxx message of as many bytes with the same UCX settings (UCX without pdserve's protocol).
`cross_ns_ratio` is UCX's best over TCP's best at the largest size; each size also gives the median and
the range of UCX's speed over TCP's, round by round. Needs root and iproute2 (`ip netns`); the namespaces
and the veth pair are removed afterwards, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2, or no CAP_NET_ADMIN)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class VethPair:
    prefill_ns: str
    decode_ns: str
    prefill_dev: str
    prefill_address: str

    def tx_bytes(self) -> int:
        """Bytes the prefill namespace's end has sent: what crossed the interface."""
        done = subprocess.run(["ip", "netns", "exec", self.prefill_ns, "cat",
                               f"/sys/class/net/{self.prefill_dev}/statistics/tx_bytes"], capture_output=True, text=True, check=False)
        return int(done.stdout)


@contextmanager
def veth_pair(mtu: int = 1500):
    """Two namespaces, prefill (10.213.N.1) and decode (10.213.N.2), joined by one veth pair."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("iproute2's `ip` is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    tag = secrets.token_hex(3)
    ns_a, ns_b, dev_a, dev_b = f"pds-p-{tag}", f"pds-d-{tag}", f"pdsp{tag}", f"pdsd{tag}"
    subnet = f"10.213.{int(tag[:2], 16)}"
    made = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", dev_a, "mtu", str(mtu), "netns", ns_a, "type", "veth", "peer", "name", dev_b,
            "mtu", str(mtu), "netns", ns_b)
        for ns, dev, host in ((ns_a, dev_a, 1), (ns_b, dev_b, 2)):
            _ip("-n", ns, "addr", "add", f"{subnet}.{host}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield VethPair(ns_a, ns_b, dev_a, f"{subnet}.1")
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _in_ns(ns: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pdserve.bench.netns_peer", *args],
                            env=env, text=True, **kwargs)


def _expect(proc: subprocess.Popen, word: str, what: str) -> None:
    if proc.stdout.readline().strip() != word:
        raise RuntimeError(f"the {what} failed")


def _step(proc: subprocess.Popen, what: str) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()
    _expect(proc, "done", what)


def end_server(proc: subprocess.Popen) -> None:
    """A peer that serves until its stdin closes: close it, then kill the peer if it has not exited in 30 s."""
    proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def paired_runs(link: VethPair, layout: str, num_blocks: int, nbytes: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per raw TCP stream (decode namespace to prefill's), per raw ucxx message (prefill to decode,
    the workers' UCX settings, no pdserve protocol) and per UCX pull of one handoff (prefill's pool to
    decode's), taken in turn `repeats` times: each round sees the same machine, so a load that comes and
    goes moves all three. The first ucxx message and pull pay connection setup and are not timed."""
    ns_a, ns_b, host_a = link.prefill_ns, link.decode_ns, link.prefill_address
    tcp_args = (host_a, "47613", str(nbytes), str(repeats))
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    recv = _in_ns(ns_a, "tcp-recv", *tcp_args, stdout=subprocess.PIPE)
    export = _in_ns(ns_a, "ucx-export", host_a, layout, str(num_blocks), str(repeats + 1), **pipes)
    ucxx_send = _in_ns(ns_a, "ucxx-send", str(nbytes), **pipes)
    steppers: dict[str, subprocess.Popen] = {}
    try:
        _expect(recv, "listening", "TCP receiver")
        params, ucxx_port = export.stdout.readline(), ucxx_send.stdout.readline().strip()
        if not params or not ucxx_port.isdigit():
            raise RuntimeError("the UCX exporter did not start")
        steppers["tcp"] = _in_ns(ns_b, "tcp-send", *tcp_args, **pipes)
        steppers["ucxx"] = _in_ns(ns_b, "ucxx-recv", host_a, ucxx_port, str(nbytes), **pipes)
        steppers["ucx"] = _in_ns(ns_b, "ucx-pull", layout, str(num_blocks), **pipes)
        steppers["ucx"].stdin.write(params)
        steppers["ucx"].stdin.flush()
        for name, proc in steppers.items():
            _expect(proc, "ready", name)
        for _ in range(repeats):
            for name, proc in steppers.items():
                _step(proc, name)
        times = {"tcp": json.loads(recv.stdout.readline())}
        for name in ("ucxx", "ucx"):
            proc = steppers[name]
            proc.stdin.close()
            times[name] = json.loads(proc.stdout.readline() or "null")
            if proc.wait(120) != 0 or times[name] is None:
                raise RuntimeError(f"the {name} receiver failed ({proc.returncode})")
        return times
    finally:
        for proc in (export, ucxx_send):
            end_server(proc)
        _stop(recv, *steppers.values())


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run(sizes_mib: list[int], repeats: int, layout: str = "llama-125m") -> dict[str, Any]:
    rows = []
    with veth_pair() as link:  # first: a machine without namespaces is told so before anything else loads
        from pdserve.bench.transfer import LAYOUTS

        block_nbytes = LAYOUTS[layout].block_nbytes
        for size in sizes_mib:
            num_blocks = max(1, size * MIB // block_nbytes)
            nbytes = num_blocks * block_nbytes
            sent = link.tx_bytes()
            times = paired_runs(link, layout, num_blocks, nbytes, repeats)
            tcp, ucxx, ucx = times["tcp"], times["ucxx"], times["ucx"]
            # the pulls' and ucxx messages' bytes crossed the veth interface (not CMA or shared memory between
            # the namespaces); TCP's data goes the other way
            wire_bytes_per_pull = (link.tx_bytes() - sent - (repeats + 1) * nbytes) / (repeats + 1)
            tcp_gb_s, ucxx_gb_s, ucx_gb_s = (nbytes / min(t) / 1e9 for t in (tcp, ucxx, ucx))
            paired = [t / u for t, u in zip(tcp, ucx)]  # UCX's speed over TCP's, round by round
            rows.append({"bytes": nbytes, "num_blocks": num_blocks, "layout": layout,
                         "tcp_gb_s": round(tcp_gb_s, 3), "ucx_gb_s": round(ucx_gb_s, 3),
                         "ratio": round(ucx_gb_s / tcp_gb_s, 3),
                         "paired_ratio_median": round(_median(paired), 3),
                         "paired_ratio_min_max": [round(min(paired), 3), round(max(paired), 3)],
                         "ucxx_gb_s": round(ucxx_gb_s, 3), "ucxx_over_tcp": round(ucxx_gb_s / tcp_gb_s, 3),
                         "ucx_over_ucxx": round(ucx_gb_s / ucxx_gb_s, 3),
                         "ucx_wire_bytes_per_pull": int(wire_bytes_per_pull),
                         "tcp_s": [round(t, 5) for t in tcp], "ucxx_s": [round(t, 5) for t in ucxx],
                         "ucx_s": [round(t, 5) for t in ucx]})
    return {"bench": "transfer-cross-ns", "link": "veth pair between two network namespaces, MTU 1500",
            "ucx": "workers' default config (endpoint error handling on), pull of one handoff",
            "method": f"{repeats} rounds of a TCP stream, a raw ucxx message and a UCX pull, in turn; ratio: UCX's "
                      "best over TCP's best; ucxx: UCX alone (same settings, one message, no pdserve protocol)",
            "copies_per_handoff": {"ucx": "1 send from the prefill pool, 1 receive into the decode pool"},
            "rows": rows, "cross_ns_ratio": rows[-1]["ratio"],
            "cross_ns_paired_ratio_median": rows[-1]["paired_ratio_median"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.netns", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sizes-mib", default="16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    try:
        result = run([int(s) for s in args.sizes_mib.split(",")], args.repeats)
    except (NetnsUnavailable, RuntimeError) as exc:
        print(f"bench cross-ns: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
