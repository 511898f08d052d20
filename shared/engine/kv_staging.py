"""Decode side of a handoff sent in parts: one reservation for the whole prompt, filled by each KVPart as
it comes while prefill still runs, then by the tail handoff, whose import waits only for the parts in
flight and the tail itself.

A staged import that fails (a pull, the layout, no room) releases its reservation as soon as no pull
is in flight on it, and its tail import falls back like a whole-handoff import. One that nobody ends
(`take`/`drop`) is released by the engine when its lease expires; each part renews that lease.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from pdserve.api.contract import HandoffParams, KVPart
from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.lease import Lease
from pdserve.kvcache.layout import LayoutMismatch
from pdserve.kvcache.transports.base import KVTransferError, KVTransport
from pdserve.kvcache.wire import WireError

MAX_ENDED = 4096


@dataclass
class StagedImport:
    num_tokens: int  # the whole prompt's
    created_at: float = field(default_factory=time.monotonic)
    lease: Lease | None = None
    reserving: asyncio.Task | None = None
    num_filled_blocks: int = 0
    num_parts: int = 0
    in_flight: int = 0
    failure: tuple[str, str] | None = None  # (fallback reason, error)
    ended: bool = False  # taken by the tail import, or dropped
    dropped: bool = False  # ended with nobody to adopt it: its reservation is released
    released: bool = False
    pull_s: float = 0.0  # time spent pulling parts
    path: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def pull_failure(exc: BaseException) -> tuple[str, str] | None:
    """The fallback reason for an exception out of a pull (as KVImporter counts them); None: not a pull error."""
    if isinstance(exc, LayoutMismatch):
        return "layout_mismatch", str(exc)
    if isinstance(exc, WireError):
        return "corrupt_payload", str(exc)
    if isinstance(exc, (KVTransferError, TimeoutError, OSError)):
        return "transfer_failed", str(exc)
    return None


class StagedImports:
    def __init__(self, engine: AsyncLLMEngine, transport: KVTransport, max_age_s: float = 60.0) -> None:
        self.engine = engine
        self.transport = transport
        self.max_age_s = max_age_s
        self.staged: dict[str, StagedImport] = {}
        self.num_parts_staged = 0  # parts pulled, in all
        self.last_refusal = ""  # why the last part was refused (request id, reason, error): for operators
        self.failures: Counter[str] = Counter()  # staged imports that failed, by fallback reason
        self.ended: OrderedDict[str, float] = OrderedDict()  # recently ended imports: their late parts are refused

    def __len__(self) -> int:
        return len(self.staged)

    async def stage(self, request_id: str, part: KVPart) -> bool:
        """Pull `part` into the request's reservation (made on its first part); False once it failed."""
        await self._purge()
        if request_id in self.ended:
            return False  # a late part: its import already ended
        st = self.staged.get(request_id)
        if st is None:
            st = self.staged[request_id] = StagedImport(part.num_prompt_tokens)
        st.num_tokens = st.num_tokens or part.num_prompt_tokens  # the tail's call may have come first
        if st.failure is not None or st.ended:
            return False
        params = part.params
        if params.layout_hash != self.transport.layout.layout_hash:
            return await self._fail(st, "layout_mismatch", f"peer layout {params.layout_hash:#018x} != ours")
        st.in_flight += 1
        try:
            if st.lease is None:
                if st.reserving is None:
                    st.reserving = asyncio.get_running_loop().create_task(self.engine.reserve_kv(st.num_tokens))
                try:
                    st.lease = await asyncio.shield(st.reserving)
                except MemoryError as exc:
                    return self._refused(request_id, st, "no_kv_capacity", str(exc))
                if st.ended:
                    return False
            else:
                await self.engine.renew_lease(st.lease.lease_id)
            dest = list(st.lease.block_ids[params.first_block: params.first_block + len(params.block_ids)])
            if len(dest) != len(params.block_ids) or params.first_block != st.num_filled_blocks:
                return self._refused(request_id, st, "layout_mismatch", (
                    f"part at block {params.first_block} does not follow {st.num_filled_blocks} blocks of "
                    f"{len(st.lease.block_ids)}"))
            start = time.monotonic()
            try:
                st.path = await self.transport.pull(params, dest)
            except Exception as exc:  # noqa: BLE001 - any failed pull fails the import, which then falls back
                reason, error = pull_failure(exc) or ("transfer_failed", f"{type(exc).__name__}: {exc}")
                return self._refused(request_id, st, reason, error)
            except BaseException:
                st.failure = ("transfer_failed", "cancelled")
                raise
            st.pull_s += time.monotonic() - start
            st.num_filled_blocks += len(dest)
            st.num_parts += 1
            self.num_parts_staged += 1
            return True
        finally:
            st.in_flight -= 1
            st.changed.set()
            await self._release_if_done(st)

    async def take(self, request_id: str, params: HandoffParams, timeout_s: float) -> StagedImport:
        """The request's staged import once the parts before the tail (`params.first_block` blocks) are
        in, or it failed (`failure`: set too when they are not all in within `timeout_s`). The tail's call
        may come before a part's: it waits for them."""
        if request_id in self.ended:  # dropped before its tail came (a part failed, or the router gave up)
            return StagedImport(0, failure=("transfer_failed", "its parts were dropped"), ended=True)
        st = self.staged.get(request_id)
        if st is None:
            st = self.staged[request_id] = StagedImport(0)
        deadline = time.monotonic() + timeout_s
        try:
            while st.failure is None and not st.dropped and (st.in_flight or st.num_filled_blocks < params.first_block):
                st.changed.clear()
                try:
                    await asyncio.wait_for(st.changed.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    st.failure = ("transfer_failed", f"parts missing after {timeout_s:.0f} s")
        except BaseException:  # cancelled (the client gone): nobody will adopt the reservation
            self._end(request_id)
            await asyncio.shield(self._drop(st))
            raise
        self._end(request_id)
        if st.dropped and st.failure is None:
            st.failure = ("transfer_failed", "its parts were dropped")
        if st.failure is not None:
            self.failures[st.failure[0]] += 1
            await self._drop(st)
        return st

    async def drop(self, request_id: str) -> bool:
        """Ends a staged import nobody will finish (its prefill or client gone)."""
        st = self._end(request_id)
        if st is None:
            return False
        await self._drop(st)
        return True

    def _end(self, request_id: str) -> StagedImport | None:
        self.ended[request_id] = time.monotonic()
        while len(self.ended) > MAX_ENDED:
            self.ended.popitem(last=False)
        st = self.staged.pop(request_id, None)
        if st is not None:
            st.ended = True
        return st

    async def release(self, st: StagedImport) -> None:
        """Frees a taken import's reservation (its tail failed)."""
        await self._drop(st)

    async def _drop(self, st: StagedImport) -> None:
        st.ended = st.dropped = True
        st.changed.set()  # a tail waiting on it stops waiting
        if st.reserving is not None and st.lease is None:
            # the reservation is still to come: a part waiting for it may be cancelled before it comes,
            # so the drop waits for it too; whichever ends last with no pull in flight releases it
            try:
                st.lease = await asyncio.shield(st.reserving)
            except MemoryError:
                pass
        await self._release_if_done(st)

    def _refused(self, request_id: str, st: StagedImport, reason: str, error: str) -> bool:
        st.failure = (reason, error)
        self.last_refusal = f"{request_id}: {reason}: {error}"
        return False  # the caller's `finally` releases the reservation once no pull is in flight

    async def _fail(self, st: StagedImport, reason: str, error: str) -> bool:
        st.failure = (reason, error)
        await self._release_if_done(st)
        return False

    async def _release_if_done(self, st: StagedImport) -> None:
        # a buffer must outlive every pull posted on it: released only once none is in flight
        if (st.failure is not None or st.dropped) and st.in_flight == 0 and st.lease is not None \
                and not st.released:
            st.released = True  # set before the await: shielded, so a cancel cannot leave it held
            await asyncio.shield(self.engine.release_lease(st.lease.lease_id))

    async def _purge(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, st in self.staged.items() if now - st.created_at > self.max_age_s]:
            await self._drop(self._end(request_id))
