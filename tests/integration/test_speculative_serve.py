"""A speculating decode replica behind the router: a disaggregated request (prefill replica, KV over
redis, adoption on decode) continues with n-gram drafts, returns the tokens plain decoding returns,
and the replica's acceptance shows in /metrics."""

from __future__ import annotations

import pytest

from pdserve.sampling_params import SamplingParams
from pdserve.services.worker import SpeculativeSettings, WorkerConfig

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402

APP = "pdserve-spec"
PROMPT = "alpha beta gamma delta epsilon zeta eta theta, " * 6  # >= 32 tokens: disaggregated


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_blocks=64, num_cpus=1)
    decode = workers.model_copy(update={"speculative": SpeculativeSettings(num_speculative_tokens=4, prompt_lookup_min=1)})
    router = RouterConfig(num_cpus=0.5)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(decode)), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{ray_serve.http_port}"
    ray_serve.delete(APP)


def _metric(server: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def test_disaggregated_request_speculates_and_matches_plain_decoding(server):
    from pdserve.engine import LLM

    llm = LLM(model="tiny", device="cpu", dtype="float32")
    ids = llm.tokenizer.encode(PROMPT)
    expected = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    before = _metric(server, "pdserve_disaggregation_decisions_total", decision="disaggregate")
    resp = client.completions.create(model="tiny", prompt=PROMPT, temperature=0.0, max_tokens=24,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected.text
    assert _metric(server, "pdserve_disaggregation_decisions_total", decision="disaggregate") == before + 1
    verifications = _metric(server, "pdserve_spec_verifications_total", role="decode")
    drafted = _metric(server, "pdserve_spec_draft_tokens_total", role="decode")
    accepted = _metric(server, "pdserve_spec_accepted_tokens_total", role="decode")
    assert verifications > 0 and drafted >= verifications
    assert _metric(server, "pdserve_spec_acceptance_rate", role="decode") == pytest.approx(accepted / drafted)
