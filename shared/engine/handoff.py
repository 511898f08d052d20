"""Both ends of a KV handoff around an engine: export after prefill, import (or fall back) before decode.

A fallback is never silent: every one is counted by reason, and the caller prefills locally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.kv_staging import StagedImports, pull_failure
from pdserve.engine.outputs import KVHandoff
from pdserve.kvcache.layout import KVLayout, LayoutMismatch, layout_of
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError, KVTransport
from pdserve.kvcache.wire import WireError


def engine_layout(engine: AsyncLLMEngine) -> KVLayout:
    core = engine.engine
    return layout_of(core.model_config, core.config.torch_dtype, core.block_manager.block_size,
                     core.config.cache.kv_cache_dtype)


def engine_pool(engine: AsyncLLMEngine) -> KVPoolIO:
    return KVPoolIO(engine.engine.handoff_pool)


@dataclass(frozen=True)
class ImportResult:
    lease_id: str | None  # reserved blocks now holding the KV; None when falling back
    fallback_reason: str | None = None
    error: str | None = None
    path: str | None = None  # the transport path the bytes took, where the transport has several
    num_parts: int = 0  # parts pulled while prefill ran, before the tail
    transfer_s: float | None = None  # time spent pulling, parts and tail (None: not measured here)

    @property
    def ok(self) -> bool:
        return self.lease_id is not None


class KVExporter:
    """Prefill side: hands a finished prefill's leased blocks to the transport, and while the transport
    holds exports, has it forget those whose lease the engine no longer holds (expired) every
    `sweep_interval_s`."""

    def __init__(self, engine: AsyncLLMEngine, transport: KVTransport, sweep_interval_s: float = 1.0) -> None:
        self.engine = engine
        self.transport = transport
        self.sweep_interval_s = sweep_interval_s
        self._sweeper: asyncio.Task | None = None

    async def export(self, handoff: KVHandoff) -> HandoffParams:
        return await self._export(handoff.lease_id, list(handoff.block_ids), list(handoff.block_hashes),
                                  handoff.num_tokens)

    async def export_tail(self, handoff: KVHandoff) -> HandoffParams:
        """A final handoff whose leading `num_parted_blocks` went ahead as parts: only the blocks after them
        are exported (under the lease on all of them, which ends when they are pulled)."""
        k = handoff.num_parted_blocks
        if not k:
            return await self.export(handoff)
        block_size = self.engine.engine.block_manager.block_size
        params = await self._export(handoff.lease_id, list(handoff.block_ids[k:]), list(handoff.block_hashes[k:]),
                                    handoff.num_tokens - k * block_size)
        return dataclasses.replace(params, first_block=k)

    async def _export(self, lease_id: str, block_ids: list[int], block_hashes: list[int],
                      num_tokens: int) -> HandoffParams:
        try:
            params = await self.transport.export(lease_id, block_ids, block_hashes, num_tokens)
        except Exception:
            await self.engine.release_lease(lease_id)
            raise
        if self.transport.num_exports and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return params

    def forget_expired(self) -> int:
        """Forgets exports whose lease the engine no longer holds; returns how many."""
        held = self.engine.engine.leases.leases  # membership reads only: safe beside a running step
        return sum(self.transport.forget(lease_id) for lease_id in self.transport.exported_lease_ids()
                   if lease_id not in held)

    async def _sweep(self) -> None:
        while self.transport.num_exports:
            await asyncio.sleep(self.sweep_interval_s)
            self.forget_expired()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)


class KVImporter:
    """Decode side: reserve blocks, pull into them, or release them and report a fallback."""

    def __init__(self, engine: AsyncLLMEngine, transport: KVTransport) -> None:
        self.engine = engine
        self.transport = transport
        self.fallbacks: Counter[str] = Counter()

    async def import_kv(self, params: HandoffParams) -> ImportResult:
        if params.layout_hash != self.transport.layout.layout_hash:
            return self.fallback("layout_mismatch", f"peer layout {params.layout_hash:#018x} != ours")
        try:
            lease = await self.engine.reserve_kv(params.num_tokens)
        except MemoryError as exc:
            return self.fallback("no_kv_capacity", str(exc))
        try:
            path = await self.transport.pull(params, list(lease.block_ids))
        except LayoutMismatch as exc:
            await self.engine.release_lease(lease.lease_id)
            return self.fallback("layout_mismatch", str(exc))
        except WireError as exc:
            await self.engine.release_lease(lease.lease_id)
            return self.fallback("corrupt_payload", str(exc))
        except (KVTransferError, TimeoutError, OSError) as exc:
            await self.engine.release_lease(lease.lease_id)
            return self.fallback("transfer_failed", str(exc))
        except BaseException:  # cancelled: shielded, as a second cancel must not skip the release
            await asyncio.shield(self.engine.release_lease(lease.lease_id))
            raise
        return ImportResult(lease.lease_id, path=path)

    async def import_tail(self, staging: StagedImports, request_id: str, params: HandoffParams,
                          timeout_s: float) -> ImportResult:
        """The tail of a handoff whose leading blocks came as parts (`params.first_block` > 0): waits for
        the parts still in flight, pulls the tail into the rest of their reservation; or falls back."""
        st = await staging.take(request_id, params, timeout_s)
        if st.failure is not None:
            return self.fallback(*st.failure)
        dest = list(st.lease.block_ids[params.first_block:])
        if params.layout_hash != self.transport.layout.layout_hash or len(dest) != len(params.block_ids):
            await staging.release(st)
            return self.fallback("layout_mismatch", f"tail of {len(params.block_ids)} blocks does not fit "
                                                     f"{len(dest)} reserved after block {params.first_block}")
        start = time.monotonic()
        try:
            path = await self.transport.pull(params, dest)
        except Exception as exc:
            failure = pull_failure(exc)
            await staging.release(st)
            if failure is None:
                raise
            return self.fallback(*failure)
        except BaseException:
            await asyncio.shield(staging.release(st))
            raise
        return ImportResult(st.lease.lease_id, path=path or st.path, num_parts=st.num_parts,
                            transfer_s=st.pull_s + time.monotonic() - start)

    def fallback(self, reason: str, error: str) -> ImportResult:
        self.fallbacks[reason] += 1
        return ImportResult(None, reason, error)
