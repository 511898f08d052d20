"""UCX environment defaults and the process's ucxx context, shared by every UCXTransport."""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UCXConfig:
    """UCX/ucxx environment defaults. A variable already set in the environment wins; they are
    read once per process, when ucxx creates its context (the first transport to start).

    tls: host pools speak TCP (between hosts, and on loopback), CMA (single-copy reads between
        processes on one host, where UCX selects it) and self (in process); naming them spares
        CPU-only hosts the probing of InfiniBand and GPU transports. None: UCX picks.
    rndv_scheme: for rendezvous-sized messages (KV blocks) the sender writes straight from its pool
        into the receiver's (CMA write, TCP zero-copy put, RDMA write). Measured here for 256 MiB
        between two processes: put_zcopy 3-4.5 GB/s with error handling on (get_zcopy then has no
        lane and UCX falls back to ~1 GB/s TCP eager), and ~8 GB/s over CMA with it off.
    endpoint_error_handling: UCX peer-failure handling on every endpoint, both sides (they must
        agree, or the connection is refused). On: a peer that dies mid-transfer raises a
        ConnectionResetError here. Off: UCX may use CMA and runs about twice as fast on one host,
        but a peer dying mid-transfer aborts this process (seen: SIGABRT from cma_ep.c), so a
        crashed prefill replica would take its decode replicas with it. On by default.
    progress_mode, python_future: a progress thread plus Python futures notified by ucxx's
        notifier thread. Without the futures every pending receive (an idle connection waiting
        for its next pull) polls the event loop: measured one full core per process.
    warn_unused_env_vars: off, since ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows.
    """

    tls: str | None = "tcp,cma,self"  # UCX_TLS
    rndv_scheme: str = "put_zcopy"  # UCX_RNDV_SCHEME
    endpoint_error_handling: bool = True
    progress_mode: str = "thread"  # UCXPY_PROGRESS_MODE
    python_future: bool = True  # UCXPY_ENABLE_PYTHON_FUTURE
    warn_unused_env_vars: bool = False  # UCX_WARN_UNUSED_ENV_VARS

    @classmethod
    def for_pool(cls, pool: KVPoolIO, endpoint_error_handling: bool = True) -> UCXConfig:
        # CUDA pools: no TLS restriction, so UCX may use rc/dc (GPUDirect RDMA), cuda_ipc and cuda_copy.
        tls = cls.tls if pool.is_host else None
        return cls(tls=tls, endpoint_error_handling=endpoint_error_handling)

    @property
    def env(self) -> dict[str, str]:
        env = {
            "UCX_RNDV_SCHEME": self.rndv_scheme,
            "UCXPY_PROGRESS_MODE": self.progress_mode,
            "UCXPY_ENABLE_PYTHON_FUTURE": "1" if self.python_future else "0",
            "UCX_WARN_UNUSED_ENV_VARS": "y" if self.warn_unused_env_vars else "n",
        }
        if self.tls is not None:
            env["UCX_TLS"] = self.tls
        return env


def apply_ucx_env(config: UCXConfig) -> dict[str, str]:
    """Set the config's variables unless already set; returns the values in effect. libucx reads
    UCX_WARN_UNUSED_ENV_VARS when it loads (`import ucxx`), the rest when the context is created."""
    return {name: os.environ.setdefault(name, value) for name, value in config.env.items()}


class _Context:
    """The process's ucxx context, held while any UCXTransport uses it. ucxx's notifier thread
    serves one event loop, so a process's transports share one loop; when the last of them
    closes, the context and its threads go, and the next transport (on any loop) starts afresh."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.users: weakref.WeakSet[Any] = weakref.WeakSet()
        self.is_owned = False  # created by us, so ours to tear down

    def acquire(self, user: Any) -> Any:
        import ucxx

        loop = asyncio.get_running_loop()
        if self.loop is not None and self.loop is not loop:
            if not self.loop.is_closed():
                raise KVTransferError("UCX already serves another running event loop in this process")
            try:
                self._teardown(ucxx)  # transports left open on a loop that is gone
            except ucxx.exceptions.UCXError as e:
                raise KVTransferError(f"cannot restart UCX on a new event loop (close old transports): {e}") from e
        if self.loop is None:
            try:
                ucxx.init()
                self.is_owned = True
            except RuntimeError:  # initialised elsewhere in this process
                self.is_owned = False
            self.loop = loop
        self.users.add(user)
        return ucxx

    def release(self, user: Any) -> None:
        self.users.discard(user)
        if self.loop is not None and not self.users:
            import ucxx

            try:
                self._teardown(ucxx)
            except ucxx.exceptions.UCXError as e:
                logger.warning("UCX context not torn down: %s", e)

    def _teardown(self, ucxx: Any) -> None:
        self.loop, self.users = None, weakref.WeakSet()
        ctx = ucxx.core._ctx
        if self.is_owned and ctx is not None:
            if ctx.worker.enable_python_future:
                ctx.worker.stop_request_notifier_thread()  # wake it now rather than after its 1 s poll
            del ctx
            ucxx.reset()


ucx_context = _Context()


def create_listener(ucxx: Any, handler: Any, port: int, endpoint_error_handling: bool) -> Any:
    """ucxx.create_listener, except that the accepted endpoints really get `endpoint_error_handling`:
    ucxx 0.52 creates them inside the C++ listener with error handling always on, so a client
    without it is refused ("error handling level mismatch"). Off, we accept the connection request
    ourselves and create the endpoint with the flag, then hand it to ucxx's usual handshake (ucxx
    internals, checked against 0.52).

    The socket listens on every interface: ucxx 0.52's Python API has no bind address (its C++
    ListenerBuilder::host is not exposed). Reading an accepted endpoint's local address with
    ucp_ep_query to drop other interfaces segfaulted UCX (on a fresh endpoint, and on one whose peer had
    gone), so nothing filters by interface: a pull needs the lease id and its secret (HandoffParams)."""
    if endpoint_error_handling:
        return ucxx.create_listener(handler, port=port)
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib_async import listener as ucxx_listener

    needed = ("_ListenerHandlerTracker", "_listener_handler", "Listener")
    if not all(hasattr(ucxx_listener, name) for name in needed) or not hasattr(
        ucx_api.UCXListener, "create_endpoint_from_conn_request"
    ):
        raise KVTransferError(f"endpoint_error_handling=False needs ucxx 0.52's listener internals "
                              f"(this is ucxx {getattr(ucxx, '__version__', '?')})")

    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    loop = asyncio.get_running_loop()
    tracker = ucxx_listener._ListenerHandlerTracker()
    raw: list[Any] = []

    def on_connect(conn_request: int) -> None:  # ucxx's progress thread
        endpoint = raw[0].create_endpoint_from_conn_request(conn_request, False)
        ucxx_listener._listener_handler(endpoint, loop, handler, weakref.ref(ctx), False, 5.0, tracker)

    raw.append(ucx_api.UCXListener.create(worker=ctx.worker, port=port, cb_func=on_connect, deliver_endpoint=False))
    return ucxx_listener.Listener(raw[0], tracker, ctx)


def ucx_error() -> type[Exception]:
    from ucxx.exceptions import UCXError

    return UCXError
