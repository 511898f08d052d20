"""`pdserve serve` in a subprocess with the `tiny` model on free ports: HTTP and gRPC stream the same tokens.

Its twin with no flags at all, `make serve` as users run it, is test_make_serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from pdserve.runtime.ports import listen_port

pytest.importorskip("ray")


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except (urllib.error.URLError, OSError):
        return 0


async def _grpc_text(port: int) -> str:
    from pdserve.v1.client import GenerateClient

    async with GenerateClient(f"127.0.0.1:{port}") as client:
        parts = [c.text async for c in client.generate(model="tiny", text="Hello there, pdserve", max_tokens=8,
                                                        ignore_eos=True, temperature=0.0)]
    return "".join(parts)


@contextlib.contextmanager
def _serving(log_path, *flags: str):
    """`pdserve serve FLAGS` until it says it is serving and /health answers; then one Ctrl-C and its exit awaited
    (killed after 60 s). The router answers /health before Serve reports the app RUNNING, and a Ctrl-C in that
    gap stops `pdserve serve` before its serving line, as a user's would."""
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "serve", *flags],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    port = flags[flags.index("--port") + 1]
    try:
        deadline = time.monotonic() + 150
        while "pdserve is serving" not in log_path.read_text() or _get(f"http://127.0.0.1:{port}/health") != 200:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not become healthy"
            time.sleep(1)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_pdserve_serve_streams_a_completion_and_shuts_down(tmp_path):
    port, grpc_port = listen_port(), listen_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--model", "tiny"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 150
        while "pdserve is serving" not in (tmp_path / "serve.log").read_text() or _get(
            f"http://127.0.0.1:{port}/health"
        ) != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not become healthy"
            time.sleep(1)
        body = json.dumps({"model": "tiny", "prompt": "Hello there, pdserve", "max_tokens": 8,
                           "stream": True, "ignore_eos": True, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            lines = [line.decode().strip() for line in response if line.strip()]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert asyncio.run(_grpc_text(grpc_port)) == text  # the same greedy tokens over gRPC
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    output = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert f"http://127.0.0.1:{port}" in output and "curl" in output and "shutting down" in output


def test_a_config_that_can_never_be_scheduled_fails_at_once_with_advice(tmp_path):
    import multiprocessing

    replicas = str(4 * multiprocessing.cpu_count() + 4)  # more model replicas than this machine can place
    done = subprocess.run(  # the timeout: it must end on its own, never wait for CPUs that never come
        [sys.executable, "-m", "pdserve.services.cli", "serve", "--model", "tiny", "--port", str(listen_port()),
         "--grpc-port", "0", "--prefill-replicas", replicas, "--decode-replicas", replicas],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cannot start" in done.stderr and "--prefill-replicas / --decode-replicas" in done.stderr
    assert "pdserve is serving" not in done.stdout


def test_sigterm_stops_pdserve_serve_like_ctrl_c_and_leaves_no_process(tmp_path):
    """What Kubernetes and systemd send. ray.init installs a SIGTERM handler of its own that kills Ray's
    processes and exits at once (no Serve shutdown, Ray's agents left behind); pdserve must keep its own."""
    import psutil

    port = listen_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli", "serve", "--port", str(port), "--grpc-port", "0",
         "--model", "tiny"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 150
        while "pdserve is serving" not in (tmp_path / "serve.log").read_text() or _get(
                f"http://127.0.0.1:{port}/health") != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not become healthy"
            time.sleep(1)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert descendants  # Ray's processes, the replicas, Redis
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    _, alive = psutil.wait_procs(descendants, timeout=30)
    for p in alive:  # ours: end them before anything can fail
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    output = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "shutting down" in output and "pdserve serve: stopped" in output
    assert not alive, [p.pid for p in alive]


def test_a_redis_url_in_the_config_file_is_used_and_no_local_redis_starts(tmp_path, redis_server):
    """`pdserve serve --config` with `redis_url` set in the file (not the flag): the KV handoff goes through that
    server (transport redis) and no Redis of pdserve's own is started beside it."""
    import redis

    port = listen_port()
    (tmp_path / "system.yaml").write_text(json.dumps({"model": "tiny", "transport": "redis",
                                                      "redis_url": redis_server.url}))
    client = redis.Redis.from_url(redis_server.url)
    before = client.info("stats")["total_commands_processed"]
    with _serving(tmp_path / "serve.log", "--config", str(tmp_path / "system.yaml"), "--port", str(port),
                  "--grpc-port", "0") as proc:
        body = json.dumps({"model": "tiny", "prompt": "A prompt long enough to take the prefill pool. " * 3,
                           "max_tokens": 4, "ignore_eos": True, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["choices"][0]["finish_reason"] == "length"
    output = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    # pdserve serve's own lines only. Ray forwards other processes' log lines into the same stream, prefixed
    # "(ServeReplica ...)" / "(raylet)"; in one CI run the phrase turned up mid-output, after the CPU split line,
    # while the serve process's own line would have come first (it is printed before Ray starts)
    own = [line for line in output.splitlines() if not line.lstrip().startswith(("(", "\x1b["))]
    assert not [line for line in own if line.startswith("started a local Redis")], \
        [line for line in output.splitlines() if "local Redis" in line]
    serving = [line for line in output.splitlines() if "pdserve is serving" in line]
    assert serving and "redis transport" in serving[0], serving or output[-3000:]
    assert client.info("stats")["total_commands_processed"] > before + 2  # the handoff used this server


def test_pdserve_serve_with_ranks_on_both_roles_hands_kv_over_and_leaves_no_rank(tmp_path):
    """`pdserve serve --tensor-parallel-size 2` as a user runs it (disaggregated, the default): the prompt's KV
    moves from 2 prefill ranks to 2 decode ranks, the greedy text equals one process's, and Ctrl-C ends
    every rank."""
    import psutil

    from pdserve.engine import LLM
    from pdserve.sampling_params import SamplingParams

    messages = [{"role": "user", "content": "Explain how a prefill pool hands its KV cache to a decode pool "
                                            "when each splits the model's attention heads."}]
    llm = LLM(model="tiny", device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].text
    port, grpc_port = str(listen_port()), str(listen_port())
    with _serving(tmp_path / "serve.log", "--model", "tiny", "--tensor-parallel-size", "2", "--port", port,
                  "--grpc-port", grpc_port) as proc:
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "pdserve.engine.tp_worker" in " ".join(p.cmdline())]
        assert len(ranks) == 2, "one worker rank per replica, prefill and decode"
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.load(response)["choices"][0]["message"]["content"] == expected
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert any(line.startswith("pdserve_kv_transfer_bytes_count{") and 'role="decode"' in line
                   and 'transport="shm"' in line and line.endswith(" 1.0") for line in metrics.splitlines())
    output = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert "tensor parallel: prefill 2, decode 2" in output
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
