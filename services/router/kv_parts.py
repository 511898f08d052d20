"""The router's side of a handoff in parts: each KVPart a prefill stream yields goes on to the decode
replica placed for the request, one at a time and in order, while the prefill goes on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.api.contract import KVPart, WorkerRequest

logger = logging.getLogger(__name__)


class PartSender:
    """Forwards parts to `request.replica` (the decode replica) through `workers`; remembers their leases
    (on the prefill replica) so that a request that ends without its tail import can free them."""

    def __init__(self, workers, request: WorkerRequest, worker_gone: tuple[type[BaseException], ...],
                 spawn: Callable) -> None:
        self.workers, self.request, self.worker_gone, self.spawn = workers, request, worker_gone, spawn
        self.lease_ids: list[str] = []
        self.num_staged = 0
        self.failed = False  # a part was refused or lost: decode's staged import is dropped
        self._queue: asyncio.Queue[KVPart] = asyncio.Queue()
        self._pump: asyncio.Task | None = None

    def send(self, part: KVPart) -> None:
        self.lease_ids.append(part.params.lease_id)
        if self.failed:
            return
        self._queue.put_nowait(part)
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            part = await self._queue.get()
            try:
                staged = await self.workers.kv_part(self.request, part)
            except self.worker_gone:
                self.failed = True  # the decode replica is gone: its stream fails over when it is called
                return
            except Exception as exc:  # noqa: BLE001 - any other failure: the part is not staged, decode falls back
                logger.warning("KV part of %s not staged on %s: %s: %s", self.request.request_id,
                               self.request.replica, type(exc).__name__, exc)
                staged = False
            if not staged:
                self.failed = True
                self.spawn(self.workers.drop_staged(self.request))
                return
            self.num_staged += 1

    def abandon(self) -> None:
        """The request will not import its tail here: stop sending, and free what decode staged."""
        if self._pump is not None:
            self._pump.cancel()
            self.spawn(self.workers.drop_staged(self.request))
            self._pump = None
