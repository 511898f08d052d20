"""A shared-prefix trace in the Mooncake format: multi-turn chats that resend their history, over a few long
system prompts shared by many users.

    python -m pdserve.loadtest.prefix_trace --out loadtest/scenarios/traces/prefix-routing.jsonl

Each hash id stands for `block_size` tokens (the `mooncake` workload's `block_size`). A chat's first
turn is its system prompt's ids and a user message; every later turn resends the whole previous
prompt, then the assistant's reply and a new user message, so turn k+1 shares turn k's prompt as its
prefix. Chats start spread over one think time and each waits a think time between turns; arrivals are
the timestamps (the sweep time-scales them to its rate). Deterministic in the seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np


def chat_trace(
    *, num_chats: int = 20, turns: tuple[int, int] = (3, 5), num_system_prompts: int = 3,
    system_blocks: int = 16, user_blocks: tuple[int, int] = (2, 4), reply_blocks: int = 1,
    output_len: tuple[int, int] = (24, 64), think_s: tuple[float, float] = (6.0, 14.0), seed: int = 0,
) -> list[dict[str, Any]]:
    """Requests sorted by arrival: `timestamp` (ms), `input_blocks` (the number of hash ids), `output_length`,
    `hash_ids`, plus `chat` and `turn` for reading; `write_trace` turns blocks into `input_length` tokens."""
    rng = np.random.default_rng(seed)
    next_id = iter(range(10**9))
    systems = [[next(next_id) for _ in range(system_blocks)] for _ in range(num_system_prompts)]
    records = []
    for chat in range(num_chats):
        ids = list(systems[chat % num_system_prompts])
        t = rng.uniform(0, think_s[1])
        for turn in range(int(rng.integers(turns[0], turns[1] + 1))):
            if turn:
                ids += [next(next_id) for _ in range(reply_blocks)]
                t += rng.uniform(*think_s)
            ids += [next(next_id) for _ in range(int(rng.integers(user_blocks[0], user_blocks[1] + 1)))]
            records.append({"timestamp": round(t * 1000), "input_blocks": len(ids), "hash_ids": list(ids),
                            "output_length": int(rng.integers(output_len[0], output_len[1] + 1)),
                            "chat": chat, "turn": turn})
    records.sort(key=lambda r: r["timestamp"])
    return records


def write_trace(records: list[dict[str, Any]], path: Path, block_size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            row = {"timestamp": r["timestamp"], "input_length": r["input_blocks"] * block_size,
                   **{k: v for k, v in r.items() if k not in ("timestamp", "input_blocks")}}
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--block-size", type=int, default=64, help="tokens per hash id (the workload's block_size)")
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--system-prompts", type=int, default=3)
    ap.add_argument("--system-blocks", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    records = chat_trace(num_chats=args.chats, num_system_prompts=args.system_prompts,
                         system_blocks=args.system_blocks, seed=args.seed)
    write_trace(records, args.out, args.block_size)
    lengths = [len(r["hash_ids"]) * args.block_size for r in records]
    print(json.dumps({"requests": len(records), "chats": args.chats,
                      "mean_prompt_tokens": float(np.mean(lengths)), "max_prompt_tokens": max(lengths),
                      "span_s": records[-1]["timestamp"] / 1000}))


if __name__ == "__main__":
    main()
