"""Both ends of a KV handoff around an engine: export after prefill, import (or fall back) before decode.

A fallback is never silent: every one is counted by reason, and the caller prefills locally.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from pdserve.engine.async_engine import AsyncLLMEngine
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
    return KVPoolIO(engine.engine.runner.kv_pool)


@dataclass(frozen=True)
class ImportResult:
    lease_id: str | None  # reserved blocks now holding the KV; None when falling back
    fallback_reason: str | None = None
    error: str | None = None
    path: str | None = None  # the transport path the bytes took, where the transport has several

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
        try:
            params = await self.transport.export(
                handoff.lease_id, list(handoff.block_ids), list(handoff.block_hashes), handoff.num_tokens
            )
        except Exception:
            await self.engine.release_lease(handoff.lease_id)
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
            return self._fallback("layout_mismatch", f"peer layout {params.layout_hash:#018x} != ours")
        try:
            lease = await self.engine.reserve_kv(params.num_tokens)
        except MemoryError as exc:
            return self._fallback("no_kv_capacity", str(exc))
        try:
            path = await self.transport.pull(params, list(lease.block_ids))
        except LayoutMismatch as exc:
            await self.engine.release_lease(lease.lease_id)
            return self._fallback("layout_mismatch", str(exc))
        except WireError as exc:
            await self.engine.release_lease(lease.lease_id)
            return self._fallback("corrupt_payload", str(exc))
        except (KVTransferError, TimeoutError, OSError) as exc:
            await self.engine.release_lease(lease.lease_id)
            return self._fallback("transfer_failed", str(exc))
        except BaseException:  # cancelled: shielded, as a second cancel must not skip the release
            await asyncio.shield(self.engine.release_lease(lease.lease_id))
            raise
        return ImportResult(lease.lease_id, path=path)

    def _fallback(self, reason: str, error: str) -> ImportResult:
        self.fallbacks[reason] += 1
        return ImportResult(None, reason, error)
