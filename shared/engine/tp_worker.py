"""A tensor-parallel worker rank (`python -m pdserve.engine.tp_worker`, arguments as JSON on stdin): load
and shard the model, report to the driver through the store, then run each broadcast step's forward."""

from __future__ import annotations

import datetime
import json
import sys
import traceback

import torch
import torch.distributed as dist

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_group import STEP, STOP, bind_group, broadcast, load_shard, make_groups, worker_config
from pdserve.engine.tp_kv import serve_command
from pdserve.engine.tp_step import unpack_step


def run_worker(rank: int, world_size: int, port: int, model_dir: str, config: dict, num_blocks: int,
               max_positions: int | None, num_threads: int, step_timeout_s: float) -> None:
    config = worker_config(config)
    torch.set_num_threads(num_threads)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=step_timeout_s))
    try:
        model, local = load_shard(model_dir, config, rank, world_size, max_positions)
        model.lm_head = None  # logits are the driver's
        runner = ModelRunner(model, local, config.cache.block_size, num_blocks, config.torch_dtype, config.device,
                             attention_override=config.attention_backend, kv_cache_dtype=config.cache.kv_cache_dtype)
    except BaseException:
        store.set(f"loaded/{rank}", traceback.format_exc())
        raise
    store.set(f"loaded/{rank}", "ok")
    control, ops = make_groups(store, rank, world_size, step_timeout_s)
    bind_group(model, ops)
    header = torch.zeros(2, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            broadcast(control, header)  # [command, payload length]
            if header[0].item() == STOP:
                break
            payload = torch.empty(int(header[1]), dtype=torch.int64)
            broadcast(ops, payload)
            if header[0].item() != STEP:  # a KV move between steps: the payload is its block ids
                serve_command(int(header[0]), payload, runner.kv_pool, lambda t: ops.send([t], 0, 0).wait(),
                              lambda t: ops.recv([t], 0, 0).wait())
                continue
            ids, positions, meta = unpack_step(payload, runner.device, runner.attention_backend, runner._workspace)
            model(ids, positions, runner.kv_caches, meta)


if __name__ == "__main__":
    run_worker(**json.load(sys.stdin))
