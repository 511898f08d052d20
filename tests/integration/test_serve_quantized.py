"""`pdserve serve` with its defaults (quantization auto, the default model: SmolLM2's Q4_1 GGUF): it answers
a chat request, and its output names what each replica serves and the configured quantization."""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from pdserve.kernels import cpu_quant
from pdserve.runtime.ports import listen_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_serve_cli import _serving  # noqa: E402

pytest.importorskip("ray")


def _replica_env(serve: psutil.Process) -> dict[str, dict[str, str]]:
    """{deployment: its replica's environment} for the Serve replicas `pdserve serve` started."""
    found = {}
    for child in serve.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            title = " ".join(child.cmdline())
            if title.startswith("ray::ServeReplica:pdserve:"):
                found[title.split(":")[-1].split()[0]] = child.environ()
    return found


def test_serve_serves_the_gguf_as_stored_by_default_and_says_what_it_serves(tmp_path, monkeypatch):
    port = listen_port()
    log = tmp_path / "serve.log"
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    with _serving(log, "--port", str(port), "--grpc-port", "0") as proc:
        replicas = _replica_env(psutil.Process(proc.pid))
        assert set(replicas) == {"router", "prefill", "decode", "kvstore"}, replicas.keys()
        # two malloc arenas a process in every replica (pdserve.runtime.serve_env)
        assert all(env.get("MALLOC_ARENA_MAX") == "2" for env in replicas.values())
        body = json.dumps({"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0,
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)["choices"][0]["message"]["content"]
    output = log.read_text()
    assert answer.strip(), output[-3000:]
    assert "quantization: prefill auto, decode auto) at" in output, output[-3000:]
    lib = cpu_quant.library()  # the replicas build the same kernel on this machine
    body, head = (f"native-{cpu_quant.isa(lib)}",) * 2 if lib is not None else ("int4", "int8_split")
    tied = ", read from the LM head's codes" if lib is not None else ""  # one copy of the tied Q8_0 table
    for role in ("prefill", "decode"):
        assert (f"{role} replica: quantization auto: 120 linears int4 (GGUF Q4_1, kernel {body}), 1 linears int8 "
                f"(GGUF Q8_0, kernel {head}); embedding from GGUF blocks (Q8_0{tied})") in output, output[-3000:]
    assert "activations float32 (dtype default; CPU has" in output
    for role in ("prefill", "decode"):  # the CPU default cache, said on each replica's line
        assert any(f"{role} replica: " in line and line.rstrip().endswith("; KV cache float16")
                   for line in output.splitlines()), output[-3000:]
