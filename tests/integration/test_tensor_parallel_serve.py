"""A colocated Serve app whose decode replica splits the tiny model over 2 ranks (SystemConfig
`decode.tensor_parallel_size: 2`), reached through the OpenAI HTTP API: the streamed greedy chat completion
equals the single-process engine's, and the replica really runs a second rank process."""

from __future__ import annotations

import psutil
import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from pdserve.sampling_params import SamplingParams
from pdserve.services.app import SystemConfig, build_system

APP, PREFIX = "pdserve-tp", "/tp"
MESSAGES = [{"role": "user", "content": "Tell me everything about tensor parallelism."}]


@pytest.fixture(scope="module")
def server(ray_serve):
    config = SystemConfig(mode="colocated", model="tiny", router={"num_cpus": 0},
                          decode={"tensor_parallel_size": 2, "num_cpus": 1, "num_blocks": 64})
    assert config.worker("decode").actor_options()["num_cpus"] == 2.0
    ray_serve.run(build_system(config), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{ray_serve.http_port}{PREFIX}"
    ray_serve.delete(APP)


def test_streamed_chat_equals_the_single_process_engine(server, replica_pids):
    from pdserve.engine import LLM

    (pid,) = replica_pids(APP, "decode")
    ranks = [p for p in psutil.Process(pid).children() if "pdserve.engine.tp_worker" in " ".join(p.cmdline())]
    assert len(ranks) == 1, [p.cmdline() for p in psutil.Process(pid).children()]

    llm = LLM(model="tiny", device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    expected = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, temperature=0.0,
                                                 max_tokens=16, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert expected.text  # 16 tokens of tiny's random weights decode to some text
