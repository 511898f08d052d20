"""The handoff matrix through the real services: disaggregated Serve apps whose prefill and decode replicas
split the tiny model over 1 or 2 ranks each (SystemConfig `prefill.tensor_parallel_size`,
`decode.tensor_parallel_size`), reached through the OpenAI HTTP API. The streamed greedy chat completion
equals a TP=1 engine's, the KV really moved (the decode role's transfer metrics, by transport, with the
whole model's bytes per block), on the transport the default configuration picks (shared memory on one
node) and on UCX, and no block stays leased."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdserve.engine import LLM  # noqa: E402
from pdserve.kvcache.layout import layout_of  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.app import SystemConfig, build_system  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

MESSAGES = [{"role": "user", "content": "Explain how a prefill pool hands its KV cache to a decode pool "
                                        "when each splits the model's attention heads differently."}]
MAX_TOKENS = 16
CASES = [  # (prefill TP, decode TP, transport as the metrics label it)
    (1, 1, "shm"), (1, 2, "shm"), (2, 1, "shm"), (2, 2, "shm"),
    (1, 2, "ucx"), (2, 1, "ucx"),
]


@pytest.fixture(scope="module")
def expected() -> tuple[str, int]:
    """A TP=1 engine's greedy text for the chat, and the KV bytes of its prompt in the whole model's layout."""
    llm = LLM(WorkerConfig().engine_config())  # as a replica builds it: the float16 KV cache on CPU
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    block_size = llm.engine.block_manager.block_size
    cfg = llm.engine.config
    nbytes = layout_of(llm.engine.model_config, cfg.torch_dtype, block_size, cfg.cache.kv_cache_dtype).block_nbytes
    assert out.text and len(ids) > 32  # long enough for the router to disaggregate it
    return out.text, -(-len(ids) // block_size) * nbytes


def _decode_transfers(url: str, transport: str) -> tuple[float, float]:
    """(transfers, bytes) the decode role pulled over `transport`, from the router's merged /metrics."""
    found = {"pdserve_kv_transfer_bytes_count": 0.0, "pdserve_kv_transfer_bytes_sum": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name in found and s.labels.get("role") == "decode" and s.labels.get("transport") == transport:
                found[s.name] += s.value
    return found["pdserve_kv_transfer_bytes_count"], found["pdserve_kv_transfer_bytes_sum"]


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "transport"), CASES)
def test_streamed_greedy_chat_across_tp_degrees_equals_tp1(ray_serve, expected, prefill_tp, decode_tp, transport):
    text, prompt_bytes = expected
    app = f"tp-handoff-{prefill_tp}-{decode_tp}-{transport}"
    worker = {"num_cpus": 0.5, "num_blocks": 64, "kv_same_host": transport == "shm"}
    config = SystemConfig(mode="disaggregated", model="tiny", router={"num_cpus": 0},
                          prefill={**worker, "tensor_parallel_size": prefill_tp},
                          decode={**worker, "tensor_parallel_size": decode_tp})
    ray_serve.run(build_system(config), name=app, route_prefix=f"/{app}")
    url = f"http://127.0.0.1:{ray_serve.http_port}/{app}"
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, temperature=0.0,
                                                     max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].choices[0].finish_reason == "length"
        count, nbytes = _decode_transfers(url, transport)
        assert count >= 1 and nbytes == prompt_bytes, (count, nbytes)  # one pull (or parts) of the whole model's KV
        handles = [ray_serve.get_deployment_handle(role, app_name=app) for role in ("prefill", "decode")]
        assert handles[1].fallbacks.remote().result() == {}
        deadline = time.monotonic() + 10
        while True:  # the exporter releases once the importer's ack lands
            stats = [h.stats.remote().result() for h in handles]
            if all(s["num_free_blocks"] == s["num_total_blocks"] and not s["num_leased_blocks"] for s in stats):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
    finally:
        ray_serve.delete(app)
