"""A hypothesis fuzzer over GenerateRequest's proto fields (every field, drawn from its proto type: full-range
integers, NaN and infinite doubles, any text, any oneof choice or none; half the requests with small values
every field accepts, so that many get through to the engine), sent through a real gRPC client
and Serve's gRPC proxy to a live router + prefill + decode app (redis KV transport, the `tiny` model).

Every RPC ends OK (each choice finished) or with a clean INVALID_ARGUMENT (NOT_FOUND for another model): never
INTERNAL, UNKNOWN or UNAVAILABLE, never a hang. Each error's details are a message that names no internals
(the same again when the request is sent again) and the request id; a stream's trailing metadata carries it. Afterwards the app still
serves, and nothing is left running on the router or the workers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")

from google.protobuf.descriptor import FieldDescriptor  # noqa: E402
from google.protobuf.json_format import MessageToDict  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.v1 import generate_pb2 as pb  # noqa: E402
from pdserve.v1 import generate_pb2_grpc as pb_grpc  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402


def _fuzz_checks():
    """fuzz_checks.py beside this file (pytest's importlib mode puts no test folder on sys.path)."""
    name = "pdserve_tests_fuzz_checks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fuzz_checks.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


fuzz = _fuzz_checks()

APP = "fuzz-grpc"
KEY = "sk-fuzz-grpc"
MAX_MODEL_LEN = 2048
MAX_TOKENS = 6  # a drawn max_tokens within the context limit is capped to this, so cases stay fast
NUM_CASES = 1000
RESEND_EVERY = 10  # every 10th rejected request goes again: its status and details must not change
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}

F = FieldDescriptor
INT_RANGES = {F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_UINT32: (0, 2**32 - 1),
              F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_UINT64: (0, 2**64 - 1)}
PLAUSIBLE = {"model": ["tiny"], "role": ["system", "user", "assistant", "developer", "tool"]}
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)  # proto strings are Unicode text


def value_of(field, plausible: bool) -> st.SearchStrategy:
    """Any value of the field's proto type; `plausible`: a small one that every field accepts."""
    if field.type == F.TYPE_MESSAGE:
        return message_of(field.message_type, plausible)
    if field.type in INT_RANGES:
        low, high = INT_RANGES[field.type]
        return st.integers(1, 4) if plausible else st.one_of(st.integers(max(low, -1), 8), st.integers(low, high))
    if field.type in (F.TYPE_DOUBLE, F.TYPE_FLOAT):  # floats(): NaN, infinities, huge, subnormal
        return st.floats(0.05, 1.0) if plausible else st.one_of(st.floats(-0.5, 2.5), st.floats())
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_STRING:
        known = st.sampled_from(PLAUSIBLE.get(field.name, ["a"]))
        return known if plausible and field.name in PLAUSIBLE else st.one_of(known, TEXT)
    raise NotImplementedError(f"no strategy for {field.full_name} (type {field.type})")


def message_of(descriptor, plausible: bool = False) -> st.SearchStrategy[dict]:
    """Keyword arguments of a message: each field set or not; of each oneof, one member (or, unless
    `plausible`, none)."""
    oneofs = [o for o in descriptor.oneofs if len(o.fields) > 1]  # proto3 `optional` is a oneof of one
    in_oneof = {f.name for o in oneofs for f in o.fields}
    fields = {f.name: st.lists(value_of(f, plausible), max_size=4 if plausible else 70) if _repeated(f)
              else value_of(f, plausible) for f in descriptor.fields if f.name not in in_oneof}
    parts = [st.fixed_dictionaries({}, optional=fields)]
    for oneof in oneofs:
        members = [value_of(f, plausible).map(lambda v, name=f.name: {name: v}) for f in oneof.fields]
        parts.append(st.one_of(*members) if plausible else st.one_of(st.just({}), *members))
    return st.tuples(*parts).map(lambda dicts: {k: v for d in dicts for k, v in d.items()})


def _repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == F.LABEL_REPEATED


def shape(kwargs: dict, model: str) -> dict:
    """The served model (or none) most of the time, so requests reach the engine, and short generations; a
    max_tokens over the context limit stays, to be refused."""
    kwargs = dict(kwargs)
    if model == "served":
        kwargs["model"] = "tiny"
    elif model == "absent":
        kwargs.pop("model", None)
    if kwargs.get("max_tokens", 0) <= MAX_MODEL_LEN and "max_tokens" in kwargs:
        kwargs["max_tokens"] = min(kwargs["max_tokens"], MAX_TOKENS)
    return kwargs


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_cpus=0.5)
    router = RouterConfig(api_keys=(KEY,), num_cpus=0.25, default_max_tokens=4, max_model_len=MAX_MODEL_LEN,
                          disaggregate_min_prompt_tokens=16)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix=f"/{APP}")
    channel = grpc.insecure_channel(f"127.0.0.1:{ray_serve.grpc_port}")
    yield pb_grpc.GenerateServiceStub(channel), f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    channel.close()
    ray_serve.delete(APP)


def _call(stub, request: pb.GenerateRequest, request_id: str):
    """(status, details, trailing metadata, responses) of one Generate RPC, read to its end."""
    metadata = [("application", APP), ("authorization", f"Bearer {KEY}"), ("x-request-id", request_id)]
    call = stub.Generate(request, metadata=metadata, timeout=60)
    responses = []
    try:
        responses.extend(call)
    except grpc.RpcError:
        pass
    return call.code(), call.details() or "", dict(call.trailing_metadata() or ()), responses


def _stream_problems(request: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> list[str]:
    usage = [r for r in responses if r.HasField("usage")]
    deltas = [r for r in responses if not r.HasField("usage")]
    finished = {r.index for r in deltas if r.finish_reason}
    n = request.n if request.HasField("n") else 1
    problems = []
    if finished != set(range(n)):
        problems.append(f"choices finished {sorted(finished)}, expected {n}")
    if request.include_usage and (len(usage) != 1 or responses[-1] is not usage[0]):
        problems.append(f"{len(usage)} usage messages, include_usage set")
    return problems


def test_hypothesis_fuzz_of_the_grpc_generate_fields(server, ray_serve):
    stub, url = server
    codes: Counter = Counter()
    failures: list[tuple[str, str]] = []  # (kind, details)
    rejected = 0

    @settings(max_examples=NUM_CASES, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(kwargs=st.one_of(message_of(pb.GenerateRequest.DESCRIPTOR, plausible=True),
                            message_of(pb.GenerateRequest.DESCRIPTOR)),
           model=st.sampled_from(["served", "served", "absent", "generated"]))
    def one(kwargs, model):
        nonlocal rejected
        request = pb.GenerateRequest(**shape(kwargs, model))
        request_id = f"fuzz-grpc-{sum(codes.values())}"
        code, details, trailing, responses = _call(stub, request, request_id)
        codes[code.name] += 1
        problems = []
        if code not in CLEAN:
            problems.append(f"status {code.name}")
        if code == grpc.StatusCode.OK:
            problems += _stream_problems(request, responses)
            if trailing.get("x-request-id") != request_id:
                problems.append(f"trailing metadata {trailing}, sent x-request-id {request_id}")
        else:
            rejected += 1
            message, _, rest = details.rpartition(" (request id ")
            if not message or rest != f"{request_id})":  # Serve drops an error's trailing metadata
                problems.append(f"details {details!r} are not a message and request id {request_id}")
            if leaked := fuzz.leaked_internals(message, MessageToDict(request)):
                problems.append(f"internals in the details: {leaked}")
            if rejected % RESEND_EVERY == 0:
                again_code, again_details = _call(stub, request, "again")[:2]
                if (again_code, again_details) != (code, f"{message} (request id again)"):
                    problems.append(f"sent again: {again_code.name} {again_details!r}")
        if problems:
            failures.append((f"{code.name}: {problems[0][:160]}",
                             f"{problems}\n{details[:300]!r}\n{json.dumps(MessageToDict(request))[:1500]}"))

    one()
    total = sum(codes.values())
    print(json.dumps({"cases": total, "resent": rejected // RESEND_EVERY, "statuses": dict(codes.most_common()),
                      "failures": len(failures)}))
    assert not failures, f"{len(failures)} of {total} requests failed; by kind, with an example:\n" + "\n\n".join(
        f"[{num}x] {kind}\n{dict(failures)[kind]}" for kind, num in Counter(k for k, _ in failures).most_common())
    assert total >= NUM_CASES and codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0, codes

    # still serving, and nothing left behind
    models = stub.Models(pb.ModelsRequest(), metadata=[("application", APP), ("authorization", f"Bearer {KEY}")],
                         timeout=30)
    assert [m.id for m in models.models] == ["tiny"]
    code, _, _, responses = _call(stub, pb.GenerateRequest(model="tiny", text="still there?", max_tokens=4,
                                                           ignore_eos=True), "fuzz-grpc-after")
    assert code == grpc.StatusCode.OK and sum(len(r.token_ids) for r in responses) == 4
    print(json.dumps({"after": fuzz.assert_idle(url, ray_serve, APP)}))
