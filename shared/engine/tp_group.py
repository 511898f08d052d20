"""The ranks of one tensor-parallel replica: the driver (rank 0, the engine's process) and world_size - 1
worker processes, in lockstep over gloo on loopback TCP.

Each step the driver broadcasts the forward's inputs (pdserve.engine.tp_step) and every rank runs the
same forward over its shard and its own KV pool (same block ids, its own heads); the all-reduces inside
the model keep the hidden states equal. Only the driver computes logits and samples; the scheduler and
the block manager live on the driver only.

Workers are plain subprocesses (`python -m pdserve.engine.tp_worker`, so a caller's script needs no
`__main__` guard as multiprocessing's spawn would), not yet Ray actors in a placement group. Two gloo
groups share one TCPStore: `control` carries the per-step command and waits as long as the engine
idles; `ops` carries the payload and the all-reduces under `step_timeout_s`, so a hung rank fails the
step. A killed rank closes its sockets and the driver's next collective raises at once.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.tp_step import pack_step
from pdserve.models.config import ModelConfig
from pdserve.models.linear import pack_linears
from pdserve.models.loader import load_model
from pdserve.models.tensor_parallel import AllReduce, shard_model

logger = logging.getLogger(__name__)

STEP, STOP = 1, 0
STEP_TIMEOUT_S = 60.0  # one collective of a step; a prefill's ranks start their layers within this
LOAD_TIMEOUT_S = 600.0
IDLE_TIMEOUT = datetime.timedelta(days=7)  # workers wait for the next step as long as the engine idles


class TensorParallelError(RuntimeError):
    """A rank died, hung past the step timeout or failed: the replica cannot step any more."""


def worker_settings(config: EngineConfig) -> dict[str, Any]:
    """The EngineConfig fields a worker rank reads, as JSON (a rank's arguments travel on its stdin)."""
    return {"model": config.model, "device": config.device, "dtype": config.resolved_dtype,
            "quantization": config.weight_quantization, "pack_weights": config.pack_weights,
            "attention_backend": config.attention_backend,
            "cache": {"block_size": config.cache.block_size, "kv_cache_dtype": config.cache.kv_cache_dtype}}


def worker_config(settings: dict[str, Any]) -> EngineConfig:
    return EngineConfig(**{**settings, "cache": CacheConfig(**settings["cache"])})


def load_shard(model_dir: str, config: EngineConfig, rank: int, world_size: int,
               max_positions: int | None) -> tuple[nn.Module, ModelConfig]:
    """Load the full model, keep this rank's shard (all-reduces unbound until `bind_group`)."""
    model, _ = load_model(model_dir, config.torch_dtype, config.device, max_positions=max_positions,
                          pack_weights=False, quantization=config.weight_quantization)
    local = shard_model(model, rank, world_size, group=None)
    if config.pack_weights:
        pack_linears(model)
    return model, local


def bind_group(model: nn.Module, group) -> None:
    for module in model.modules():
        if isinstance(module, AllReduce):
            module.group = group


def make_groups(store: dist.Store, rank: int, world_size: int, step_timeout_s: float):
    """(control, ops) gloo groups over loopback; blocks until every rank has joined."""
    def group(prefix: str, timeout: datetime.timedelta):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size, options)

    return group("control", IDLE_TIMEOUT), group("ops", datetime.timedelta(seconds=step_timeout_s))


def broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


class TensorParallelModel(nn.Module):
    """The driver's shard: each forward first sends the step to the other ranks, then runs its own part."""

    def __init__(self, model: nn.Module, config: EngineConfig, model_dir: str, num_blocks: int,
                 max_positions: int | None, step_timeout_s: float = STEP_TIMEOUT_S) -> None:
        super().__init__()
        world_size = config.tensor_parallel_size
        self.world_size = world_size
        self.failed: str | None = None
        num_threads = config.num_threads or max(1, (os.cpu_count() or 1) // world_size)
        timeout = datetime.timedelta(seconds=step_timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=timeout)
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            args = {"rank": rank, "world_size": world_size, "port": self.store.port, "model_dir": str(model_dir),
                    "config": worker_settings(config), "num_blocks": num_blocks, "max_positions": max_positions,
                    "num_threads": num_threads, "step_timeout_s": step_timeout_s}
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.tp_worker"], stdin=subprocess.PIPE)
            proc.stdin.write(json.dumps(args).encode())
            proc.stdin.close()
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        try:
            self.model = model
            self.local_config = shard_model(model, 0, world_size, group=None)
            if config.pack_weights:
                pack_linears(model)
            _wait_loaded(self.store, self.procs)
            self.control, self.ops = make_groups(self.store, 0, world_size, step_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        bind_group(model, self.ops)
        self.header = torch.zeros(2, dtype=torch.int64)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta) -> torch.Tensor:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        payload = pack_step(input_ids, positions, meta)
        try:
            self._send_header(STEP, payload.numel())
            broadcast(self.ops, payload)
            return self.model(input_ids, positions, kv_caches, meta)
        except RuntimeError as e:
            self._fail(e)

    def command(self, command: int, payload: torch.Tensor) -> None:
        """Start a non-step command (pdserve.engine.tp_kv) on every worker rank, with an int64 payload."""
        self._guarded(lambda: (self._send_header(command, payload.numel()), broadcast(self.ops, payload)))

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        self._guarded(lambda: self.ops.send([tensor], rank, 0).wait())

    def recv(self, tensor: torch.Tensor, rank: int) -> None:
        self._guarded(lambda: self.ops.recv([tensor], rank, 0).wait())

    def _send_header(self, command: int, length: int) -> None:
        self.header[0], self.header[1] = command, length
        broadcast(self.control, self.header)

    def _guarded(self, op) -> None:
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            op()
        except RuntimeError as e:
            self._fail(e)

    def _fail(self, e: RuntimeError) -> None:
        self.failed = f"tensor-parallel step failed ({self._ranks_state()}): {e}"
        self._finalizer()
        raise TensorParallelError(self.failed) from e

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def _ranks_state(self) -> str:
        return ", ".join(f"rank {i + 1} " + ("alive" if p.poll() is None else f"exited {p.returncode}")
                         for i, p in enumerate(self.procs))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (a STOP command, then a kill for any that do not exit); idempotent."""
        if not self._finalizer.alive:
            return
        if self.failed is None:
            try:
                self.header[0], self.header[1] = STOP, 0
                broadcast(self.control, self.header)
            except RuntimeError:
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()
        self.failed = self.failed or "tensor-parallel group closed"


def _wait_loaded(store: dist.Store, procs: list[subprocess.Popen]) -> None:
    """Until every worker has reported its shard loaded; raises with a worker's traceback or exit code."""
    pending = dict(enumerate(procs, start=1))
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while pending:
        for rank, proc in list(pending.items()):
            key = f"loaded/{rank}"
            if store.check([key]):
                message = store.get(key).decode()
                if message != "ok":
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to load:\n{message}")
                del pending[rank]
            elif proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while loading")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tensor-parallel ranks {sorted(pending)} did not load within {LOAD_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()
