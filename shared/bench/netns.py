"""KV transfer between two Linux network namespaces joined by a veth pair: the bytes cross a real network
interface (the kernel's veth driver and TCP stack on both sides), not loopback.

    python -m pdserve.bench.netns --json [--sizes-mib 16,64,256] [--repeats 3]

Per size, in the same run: UCX (the workers' default config, endpoint error handling on) pulling one
handoff from an exporter in the prefill namespace into a pool in the decode namespace, and a raw TCP
stream of the same bytes between the same namespaces (the wire's limit here). `cross_ns_ratio` is UCX's
best over TCP's best at the largest size. Needs root and iproute2 (`ip netns`); the namespaces and the
veth pair are removed afterwards, also on failure.
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


def tcp_stream_s(ns_a: str, ns_b: str, host_a: str, nbytes: int, repeats: int) -> list[float]:
    """Seconds per raw TCP stream of `nbytes`, prefill namespace to decode namespace."""
    port = "47613"
    recv = _in_ns(ns_a, "tcp-recv", host_a, port, str(nbytes), str(repeats), stdout=subprocess.PIPE)
    try:
        if recv.stdout.readline().strip() != "listening":
            raise RuntimeError("the TCP receiver did not start")
        send = _in_ns(ns_b, "tcp-send", host_a, port, str(nbytes), str(repeats))
        if send.wait(300) != 0:
            raise RuntimeError("the TCP sender failed")
        return json.loads(recv.stdout.readline())
    finally:
        recv.kill()
        recv.wait()


def ucx_pull_s(ns_a: str, ns_b: str, host_a: str, layout: str, num_blocks: int, repeats: int) -> list[float]:
    """Seconds per UCX pull of one handoff, exporter in the prefill namespace, puller in the decode one."""
    export = _in_ns(ns_a, "ucx-export", host_a, layout, str(num_blocks), str(repeats + 1),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        params = export.stdout.readline()
        if not params:
            raise RuntimeError("the UCX exporter did not start")
        pull = _in_ns(ns_b, "ucx-pull", layout, str(num_blocks), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out, _ = pull.communicate(params, timeout=600)
        if pull.returncode != 0:
            raise RuntimeError(f"the UCX pull failed ({pull.returncode})")
        return json.loads(out)[1:]  # the first pull pays connection setup
    finally:
        export.stdin.close()
        try:
            export.wait(30)
        except subprocess.TimeoutExpired:
            export.kill()
            export.wait()


def run(sizes_mib: list[int], repeats: int, layout: str = "llama-125m") -> dict[str, Any]:
    rows = []
    with veth_pair() as link:  # first: a machine without namespaces is told so before anything else loads
        from pdserve.bench.transfer import LAYOUTS

        block_nbytes = LAYOUTS[layout].block_nbytes
        ns_a, ns_b, host_a = link.prefill_ns, link.decode_ns, link.prefill_address
        for size in sizes_mib:
            num_blocks = max(1, size * MIB // block_nbytes)
            nbytes = num_blocks * block_nbytes
            tcp = tcp_stream_s(ns_a, ns_b, host_a, nbytes, repeats)
            sent = link.tx_bytes()
            ucx = ucx_pull_s(ns_a, ns_b, host_a, layout, num_blocks, repeats)
            # every pull's bytes crossed the veth interface (not CMA or shared memory between the namespaces)
            wire_bytes_per_pull = (link.tx_bytes() - sent) / (repeats + 1)
            tcp_gb_s, ucx_gb_s = nbytes / min(tcp) / 1e9, nbytes / min(ucx) / 1e9
            rows.append({"bytes": nbytes, "num_blocks": num_blocks, "layout": layout,
                         "tcp_gb_s": round(tcp_gb_s, 3), "ucx_gb_s": round(ucx_gb_s, 3),
                         "ratio": round(ucx_gb_s / tcp_gb_s, 3),
                         "ucx_wire_bytes_per_pull": int(wire_bytes_per_pull),
                         "tcp_s": [round(t, 5) for t in tcp], "ucx_s": [round(t, 5) for t in ucx]})
    return {"bench": "transfer-cross-ns", "link": "veth pair between two network namespaces, MTU 1500",
            "ucx": "workers' default config (endpoint error handling on), pull of one handoff",
            "copies_per_handoff": {"ucx": "1 send from the prefill pool, 1 receive into the decode pool"},
            "rows": rows, "cross_ns_ratio": rows[-1]["ratio"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.netns", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sizes-mib", default="16,64,256")
    p.add_argument("--repeats", type=int, default=3)
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
