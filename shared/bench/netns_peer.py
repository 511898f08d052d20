"""The processes of the cross-namespace transfer benchmark, each run inside one network namespace.

    python -m pdserve.bench.netns_peer tcp-send HOST PORT NBYTES REPEATS
    python -m pdserve.bench.netns_peer tcp-recv HOST PORT NBYTES REPEATS
    python -m pdserve.bench.netns_peer ucx-export HOST LAYOUT NUM_BLOCKS NUM_LEASES
    python -m pdserve.bench.netns_peer ucx-pull LAYOUT NUM_BLOCKS
    python -m pdserve.bench.netns_peer ucx-pull-each LAYOUT NUM_BLOCKS
    python -m pdserve.bench.netns_peer ucxx-send NBYTES
    python -m pdserve.bench.netns_peer ucxx-recv HOST PORT NBYTES

tcp-recv listens and prints one JSON list of seconds per stream (first byte read to last byte read); tcp-send
prints `ready`, then per stream reads one line from stdin, connects, writes NBYTES and prints `done`.
ucx-export advertises HOST in its handoff params, prints them as one JSON line and serves until stdin closes;
ucx-pull reads that line from stdin, pulls the first lease (connection setup), prints `ready`, then pulls each
further lease when a line arrives on stdin, printing `done`; at the end it checks the bytes and prints one
JSON list of seconds per timed pull. ucxx-send and ucxx-recv are UCX without pdserve: with the same UCX
settings, ucxx-send listens, prints its port, and answers each one-byte request with one message of NBYTES;
ucxx-recv steps like ucx-pull (one untimed message first), receiving into memory of its own. The controller steps the two senders in turn, so that TCP and UCX
alternate and see the same machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
import uuid

CHUNK = 1 << 20


def tcp_recv(host: str, port: int, nbytes: int, repeats: int) -> None:
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    times = []
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        for _ in range(repeats):
            conn, _ = server.accept()
            with conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                got = conn.recv_into(view[:CHUNK])
                start = time.perf_counter()  # from the first byte: connection setup is not the stream's
                while got < nbytes:
                    n = conn.recv_into(view[got : got + CHUNK])
                    if n == 0:
                        raise ConnectionError(f"stream ended after {got} of {nbytes} bytes")
                    got += n
                times.append(time.perf_counter() - start)
                conn.sendall(b"k")  # the sender waits for this: streams do not overlap
    print(json.dumps(times), flush=True)


def tcp_send(host: str, port: int, nbytes: int, repeats: int) -> None:
    payload = memoryview(_resident(nbytes))
    print("ready", flush=True)
    for _ in range(repeats):
        if not sys.stdin.readline():
            return
        with socket.create_connection((host, port), timeout=60) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            conn.sendall(payload)
            conn.recv(1)
        print("done", flush=True)


async def ucx_export(host: str, layout_name: str, num_blocks: int, num_leases: int) -> None:
    from pdserve.bench.transfer import LAYOUTS
    from pdserve.bench.ucx_peer import seeded_pool
    from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport

    layout = LAYOUTS[layout_name]
    pool = seeded_pool(layout, num_blocks)
    # the workers' default config (endpoint error handling on), advertising the namespace's veth address
    transport = UCXTransport(pool, layout, config=UCXConfig.for_pool(pool), host=host)
    await transport.start()
    ids = list(range(num_blocks))
    params = [(await transport.export(uuid.uuid4().hex, ids, list(range(1, num_blocks + 1)),
                                      num_blocks * layout.block_size)).to_dict() for _ in range(num_leases)]
    print(json.dumps(params), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await transport.close()


async def _puller(layout_name: str, num_blocks: int):
    """(layout, the handoffs read from stdin, a zeroed pool, a started UCX transport with the workers'
    default config) for a puller."""
    import torch

    from pdserve.bench.transfer import LAYOUTS
    from pdserve.kvcache.params import HandoffParams
    from pdserve.kvcache.pool import KVPoolIO, allocate_pool
    from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport

    layout = LAYOUTS[layout_name]
    all_params = [HandoffParams.from_dict(p) for p in json.loads(sys.stdin.readline())]
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    pool = KVPoolIO(allocate_pool(shape, getattr(torch, layout.dtype), "cpu").zero_())
    transport = UCXTransport(pool, layout, config=UCXConfig.for_pool(pool))
    await transport.start()
    return layout, all_params, pool, transport


async def ucx_pull(layout_name: str, num_blocks: int) -> None:
    import torch

    from pdserve.bench.ucx_peer import seeded_pool

    layout, all_params, pool, transport = await _puller(layout_name, num_blocks)
    ids = list(range(num_blocks))
    loop = asyncio.get_running_loop()
    times = []
    try:
        await transport.pull(all_params[0], ids)  # connection setup: not timed
        print("ready", flush=True)
        for params in all_params[1:]:
            if not await loop.run_in_executor(None, sys.stdin.readline):
                break
            start = time.perf_counter()
            await transport.pull(params, ids)
            times.append(time.perf_counter() - start)
            print("done", flush=True)
    finally:
        await transport.close()
    expected = seeded_pool(layout, num_blocks)
    if not all(torch.equal(expected.block_tensor(i), pool.block_tensor(i)) for i in (0, num_blocks - 1)):
        raise SystemExit("the pulled blocks differ from the exported ones")
    print(json.dumps(times), flush=True)


async def ucx_pull_each(layout_name: str, num_blocks: int) -> None:
    """Pulls each lease in turn, printing `pulling I` before each, and then one JSON list of outcomes: a pull
    that fails (its exporter killed) must fail cleanly, with this process alive to pull the next."""
    import torch

    from pdserve.bench.ucx_peer import seeded_pool

    layout, all_params, pool, transport = await _puller(layout_name, num_blocks)
    expected = seeded_pool(layout, num_blocks)
    outcomes = []
    try:
        for i, params in enumerate(all_params):
            ids = list(range(len(params.block_ids)))
            pool.kv_pool.zero_()
            print(f"pulling {i}", flush=True)
            try:
                await transport.pull(params, ids)
            except Exception as exc:
                outcomes.append({"ok": False, "error": type(exc).__name__})
                continue
            intact = all(torch.equal(expected.block_tensor(b), pool.block_tensor(b)) for b in (0, ids[-1]))
            outcomes.append({"ok": True, "intact": intact})
    finally:
        await transport.close()
    print(json.dumps(outcomes), flush=True)


class _RawUCXX:
    """ucxx with the workers' default UCX settings (endpoint error handling on), as a UCXTransport sets them,
    on the process's shared context (released on exit, so that ucxx's threads end)."""

    def __enter__(self):
        from pdserve.kvcache.transports.ucx_env import UCXConfig, apply_ucx_env, ucx_context

        apply_ucx_env(UCXConfig())
        return ucx_context.acquire(self)

    def __exit__(self, *exc) -> None:
        from pdserve.kvcache.transports.ucx_env import ucx_context

        ucx_context.release(self)


def _resident(nbytes: int):
    """Bytes held in memory like a KV pool's: `bytes(nbytes)` would map every page to the kernel's one zero
    page, which stays in cache, so a reference sender would read far fewer bytes than UCX's exporter."""
    import torch

    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy()


async def ucxx_send(nbytes: int) -> None:
    with _RawUCXX() as ucxx:
        await _ucxx_serve(ucxx, _resident(nbytes))


async def _ucxx_serve(ucxx, payload) -> None:
    endpoints = []

    async def serve(ep) -> None:
        endpoints.append(ep)
        request = bytearray(1)
        try:
            while True:
                await ep.recv(request)
                await ep.send(payload)
        except ucxx.exceptions.UCXError:  # the receiver closed
            pass

    listener = ucxx.create_listener(serve, port=0)
    print(listener.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for ep in endpoints:
        ep.abort()
    listener.close()


async def ucxx_recv(host: str, port: int, nbytes: int) -> None:
    with _RawUCXX() as ucxx:
        await _ucxx_receive(ucxx, host, port, _resident(nbytes))  # pages written once before timing


async def _ucxx_receive(ucxx, host: str, port: int, buffer) -> None:
    loop = asyncio.get_running_loop()
    ep = await ucxx.create_endpoint(host, port, endpoint_error_handling=True)
    await ep.send(bytearray(1))
    await ep.recv(buffer)
    print("ready", flush=True)
    times = []
    while await loop.run_in_executor(None, sys.stdin.readline):
        start = time.perf_counter()
        await ep.send(bytearray(1))
        await ep.recv(buffer)
        times.append(time.perf_counter() - start)
        print("done", flush=True)
    ep.abort()
    print(json.dumps(times), flush=True)


def main(argv: list[str]) -> None:
    role, args = argv[0], argv[1:]
    if role == "tcp-recv":
        tcp_recv(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif role == "tcp-send":
        tcp_send(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif role == "ucx-export":
        asyncio.run(ucx_export(args[0], args[1], int(args[2]), int(args[3])))
    elif role == "ucx-pull":
        asyncio.run(ucx_pull(args[0], int(args[1])))
    elif role == "ucxx-send":
        asyncio.run(ucxx_send(int(args[0])))
    elif role == "ucxx-recv":
        asyncio.run(ucxx_recv(args[0], int(args[1]), int(args[2])))
    elif role == "ucx-pull-each":
        asyncio.run(ucx_pull_each(args[0], int(args[1])))
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
