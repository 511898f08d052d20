"""llama.cpp's batch-1 decode on the same GGUF file, beside `pdserve bench engine`'s, against the same read
bandwidth: the peer's roofline fraction, measured in the same run.

llama.cpp runs as its server (xllamacpp, from `pdserve bench peer`'s scratch venv), one slot, as many threads
as torch has here. The b1 request (the same prompt ids, 128 tokens out, greedy, `ignore_eos`, no prompt cache)
goes to its native `/completion`, whose `timings` give its own decode time per token, with no HTTP in it.
The bytes a step reads: every tensor of the file but the token embedding (indexed), which a tied model also
reads whole as its output layer, plus the float16 K/V (llama.cpp's default cache type) at the mean context.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.peer_servers import LlamaCppServer
from pdserve.runtime.ports import listen_port

KV_CACHE_BYTES = 2  # llama.cpp's default cache type, f16


def gguf_step_weight_bytes(gguf: Path) -> int:
    """Bytes of the file's tensors a decode step reads: all but an untied token embedding (indexed rows)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """K and V of one token over every layer, in llama.cpp's default f16 cache (an HF config.json's fields)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * KV_CACHE_BYTES


def llama_cpp_decode_b1(gguf: Path, venv: Path, requirement: str, prompt: list[int], max_tokens: int,
                        threads: int, repeats: int = 2, probe: Callable[[], float] | None = None) -> dict[str, Any]:
    """The best of `repeats` b1 runs: llama.cpp's decode tok/s and prefill ms from its own timings; with
    `probe`, the read bandwidth just before and after each run too (`bw_gb_s_runs`)."""
    import httpx

    server = LlamaCppServer(venv, requirement, gguf, listen_port(), threads, 1)
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False}
    runs, readings = [], []
    with server:
        server.wait_ready()
        httpx.post(f"{server.url}/completion", json={**body, "n_predict": 8}, timeout=600).raise_for_status()
        for _ in range(repeats):
            before = probe() if probe else None
            resp = httpx.post(f"{server.url}/completion", json=body, timeout=600)
            if probe:
                readings.append([round(before, 2), round(probe(), 2)])
            resp.raise_for_status()
            timings = resp.json()["timings"]
            if timings["predicted_n"] != max_tokens:
                raise RuntimeError(f"llama.cpp predicted {timings['predicted_n']} tokens, not {max_tokens}")
            runs.append(timings)
    best = max(runs, key=lambda t: t["predicted_per_second"])
    return {"decode_tok_s_b1": round(best["predicted_per_second"], 2), "prefill_ms_b1": round(best["prompt_ms"], 1),
            "decode_tok_s_runs": [round(t["predicted_per_second"], 2) for t in runs], "threads": threads,
            "package": requirement, **({"bw_gb_s_runs": readings} if probe else {})}
