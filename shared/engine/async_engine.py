"""asyncio front of the engine: `generate` streams TokenDeltas; steps run on one worker thread.

Invariant: the engine core is touched only by the loop task (between steps, on the event loop)
and by the step itself (on the worker thread), never by both at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from concurrent.futures import ThreadPoolExecutor

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineStats, GenerationRequest, TokenDelta
from pdserve.kv_events import KVEventLog
from pdserve.runtime.heap import trim_heap


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[TokenDelta | BaseException]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-step")
        self._stepped_since_trim = False
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        # Refreshed under the lock between steps: reading the engine while a step runs is a data race.
        self._stats = engine.stats()
        # Requests waiting for the lock (a step in flight holds it) to be admitted -> their prompt tokens to
        # prefill: stats count them at once, so a router polling mid-step sees what it placed here.
        self._arriving: dict[object, int] = {}
        # Called, before any stream hears of it, when a step leaves the engine unable to step again (a
        # tensor-parallel rank lost); a serving replica exits, so that it is replaced and its streams move.
        self.on_broken: Callable[[BaseException], None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLMEngine:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        unread: list[TokenDelta] = []  # the current batch's deltas not yet handed out
        try:
            async with aclosing(self.generate_batches(request)) as batches:
                async for batch in batches:
                    unread = list(batch)
                    while unread:
                        yield unread.pop(0)
        finally:
            # closed mid-batch: the leases of the deltas nobody will read (KV parts, a handoff) end here
            for lease_id in _lease_ids(unread):
                await asyncio.shield(self.release_lease(lease_id))

    async def generate_batches(
        self, request: GenerationRequest, interval_s: float = 0.0
    ) -> AsyncIterator[list[TokenDelta]]:
        """The request's deltas, grouped: the first at once, then everything the engine produced while
        the consumer was away (one delta per batch when it keeps up, with no timer). `interval_s` > 0
        caps batches at one per interval. Closing this aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        added = False
        arrival = object()
        self._arriving[arrival] = 0 if request.adopt_lease_id is not None else len(request.prompt_token_ids)
        try:
            async with self._lock:
                del self._arriving[arrival]
                try:
                    self.engine.add_request(request)  # raises ValueError on bad input, before anything is held
                except Exception as exc:  # an adopted lease's scatter to the TP ranks may find one lost
                    self._if_broken(exc)
                    raise
                added = True
                self._queues[request.request_id] = queue
                self._stats = self.engine.stats()
        finally:
            self._arriving.pop(arrival, None)
            if not added and request.adopt_lease_id is not None:
                # cancelled (client gone) or refused before adopting: the leased KV is nobody's, free it now
                # rather than at the lease's expiry
                await asyncio.shield(self.release_lease(request.adopt_lease_id))
        self._wake_loop()
        finished = False
        last_batch: float | None = None
        try:
            while not finished:
                batch = [await queue.get()]
                if interval_s > 0 and last_batch is not None:
                    await asyncio.sleep(last_batch + interval_s - time.monotonic())
                while not queue.empty():
                    batch.append(queue.get_nowait())
                failed = next((k for k, item in enumerate(batch) if isinstance(item, BaseException)), None)
                if failed is not None:  # what preceded the failure, then the failure
                    if failed:
                        yield batch[:failed]
                    raise batch[failed]
                finished = batch[-1].finished
                last_batch = time.monotonic()
                yield batch
        finally:
            if not finished:
                # shielded: a closed stream is often cancelled again while the abort waits for the lock
                # (a worker link closes the stream, then its connection's loss cancels the call), and an
                # abort cut short leaves the request decoding for nobody until max_tokens
                await asyncio.shield(self.abort(request.request_id))
                # leases the engine handed out in deltas nobody read (KV parts, a handoff) end with them
                for lease_id in _lease_ids([d for d in _drain(queue) if isinstance(d, TokenDelta)]):
                    await asyncio.shield(self.release_lease(lease_id))

    async def abort(self, request_id: str) -> bool:
        async with self._lock:
            queue = self._queues.pop(request_id, None)
            aborted = self.engine.abort(request_id)
            self._stats = self.engine.stats()
        if queue is not None and aborted:
            # A stream aborted by someone other than its consumer ends rather than waits forever.
            queue.put_nowait(TokenDelta(request_id, (), "", finished=True, finish_reason="abort"))
        return aborted

    async def reserve_kv(self, num_tokens: int):
        async with self._lock:
            lease = self.engine.reserve_kv(num_tokens)
            self._stats = self.engine.stats()
        self._wake_loop()  # the loop expires leases, so it must run while one is held
        return lease

    async def release_lease(self, lease_id: str) -> bool:
        async with self._lock:
            released = self.engine.release_lease(lease_id)
            self._stats = self.engine.stats()
        return released

    async def renew_lease(self, lease_id: str) -> bool:
        async with self._lock:
            return self.engine.leases.renew(lease_id)

    async def cache_lease(self, lease_id: str, block_hashes: list[int]) -> int:
        async with self._lock:
            try:
                num_cached = self.engine.cache_lease(lease_id, block_hashes)
            except Exception as exc:
                self._if_broken(exc)
                raise
            self._stats = self.engine.stats()
        return num_cached

    def _if_broken(self, exc: BaseException) -> None:
        """Tell `on_broken` when `exc` left the engine unable to step again (a tensor-parallel rank lost)."""
        if self.on_broken is not None and self.engine.is_broken:
            self.on_broken(exc)

    @property
    def kv_events(self) -> KVEventLog:
        """The pool's prefix-cache events (thread-safe: read it any time)."""
        return self.engine.block_manager.events

    async def release_lease_quietly(self, lease_id: str) -> None:
        """Release callback for KV transports (an already-expired lease is not an error)."""
        await self.release_lease(lease_id)

    def stats(self) -> EngineStats:
        """Snapshot as of the last step, admission, abort or lease change; requests still waiting for a step
        in flight to end count as waiting, their prompts as queued prefill tokens."""
        if not self._arriving:
            return self._stats
        return dataclasses.replace(
            self._stats, num_waiting=self._stats.num_waiting + len(self._arriving),
            queued_prefill_tokens=self._stats.queued_prefill_tokens + sum(self._arriving.values()))

    def _wake_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        self._wakeup.set()

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # Cleared before looking for work: a wake-up from now on (new request, adoption) is kept.
            self._wakeup.clear()
            if not self.engine.has_unfinished() and not self.engine.leases.leases:
                if self._stepped_since_trim:  # idle: what the last batches' activations held goes back to the OS
                    await loop.run_in_executor(self._executor, trim_heap)
                    self._stepped_since_trim = False
                await self._wakeup.wait()
            async with self._lock:
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                    self._stepped_since_trim = True
                except Exception as exc:  # fail every in-flight request rather than hang them
                    self._if_broken(exc)
                    for queue in self._queues.values():
                        queue.put_nowait(exc)
                    self._queues.clear()
                    for request_id in list(self.engine.requests):
                        self.engine.abort(request_id)
                    outputs = []
                self._stats = self.engine.stats()
            for delta in outputs:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
                    if delta.finished:
                        del self._queues[delta.request_id]
            if not outputs:
                # Idle with leases held (they must still expire) or blocked on KV: nap, but a new request
                # ends the nap at once instead of waiting it out.
                timeout = 0.001 if self.engine.has_unfinished() else 0.05
                try:
                    await asyncio.wait_for(self._wakeup.wait(), timeout)
                except TimeoutError:
                    pass

    async def close(self) -> None:
        """Stops the loop, waits out a step in flight, and ends every open stream with an abort."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        # Cancelling the loop does not stop a step already on the worker thread: wait for it to end.
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        for request_id in list(self._queues):
            await self.abort(request_id)


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _lease_ids(deltas: list[TokenDelta]) -> list[str]:
    """The leases the engine handed out in these deltas: a KV part's or a prefill's handoff."""
    return [(d.kv_part or d.kv_handoff).lease_id for d in deltas if d.kv_part or d.kv_handoff]
