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
    rndv_scheme: for rendezvous-sized messages (KV blocks) the receiver reads straight from the
        sender's registered pool into its own (RDMA read, cuda_ipc): a pull, like our protocol.
    progress_mode, python_future: a progress thread plus Python futures notified by ucxx's
        notifier thread. Without the futures every pending receive (an idle connection waiting
        for its next pull) polls the event loop: measured one full core per process.
    warn_unused_env_vars: off, since ucxx sets UCX_MEMTYPE_CACHE, which UCX 1.21 no longer knows.
    """

    tls: str | None = "tcp,cma,self"  # UCX_TLS
    rndv_scheme: str = "get_zcopy"  # UCX_RNDV_SCHEME
    progress_mode: str = "thread"  # UCXPY_PROGRESS_MODE
    python_future: bool = True  # UCXPY_ENABLE_PYTHON_FUTURE
    warn_unused_env_vars: bool = False  # UCX_WARN_UNUSED_ENV_VARS

    @classmethod
    def for_pool(cls, pool: KVPoolIO) -> UCXConfig:
        # CUDA pools: no TLS restriction, so UCX may use rc/dc (GPUDirect RDMA), cuda_ipc and cuda_copy.
        return cls() if pool.is_host else cls(tls=None)

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


def ucx_error() -> type[Exception]:
    from ucxx.exceptions import UCXError

    return UCXError
