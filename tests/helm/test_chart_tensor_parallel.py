"""`<role>.worker.tensor_parallel_size` in the chart: a replica of n ranks asks Ray for n CPU shares and n x numGpus
GPUs, its pod must hold those GPUs, and prefill and decode may take different degrees."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
COLOCATED_TP = CHART / "ci" / "colocated-tp-values.yaml"
DISAGGREGATED_TP = CHART / "ci" / "disaggregated-tp-values.yaml"
GPU_POOLS = CHART / "ci" / "gpu-pools-values.yaml"
ENV = {"PDSERVE_REDIS_PASSWORD": "x"}


def _rayservice(objects):
    (rs,) = [o for o in objects if o["kind"] == "RayService"]
    return rs


def _app(rs):
    return yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][-1]


def _groups(rs):
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_the_colocated_example_asks_ray_for_a_cpu_per_rank(render):
    from pdserve.services.serve_builder import system_config

    rs = _rayservice(render([COLOCATED_TP]))
    app = _app(rs)
    config = system_config(app["args"], ENV)
    decode = config.worker("decode")
    assert decode.engine_config().tensor_parallel_size == 2
    # a CPU pool has no Serve override: the deployment's options are WorkerConfig's own
    assert "deployments" not in app
    assert decode.deployment_options()["ray_actor_options"]["num_cpus"] == 2.0
    assert list(_groups(rs)) == ["decode"]  # colocated: no prefill pool
    assert _groups(rs)["decode"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"


def test_a_gpu_replica_takes_numgpus_per_rank_and_its_pod_must_hold_them(render, helm):
    from ray.serve.schema import ServeDeploySchema

    from pdserve.services.serve_builder import system_config

    gpus = ["decode.resources.limits.nvidia\\.com/gpu=2", "decode.resources.requests.nvidia\\.com/gpu=2"]
    sets = ["system.mode=colocated", "decode.worker.tensor_parallel_size=2", *gpus]
    rs = _rayservice(render([GPU_POOLS], sets))
    serve_config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    (decode,) = serve_config["applications"][-1]["deployments"]
    assert decode["name"] == "decode"
    options = decode["ray_actor_options"]
    assert (options["num_gpus"], options["num_cpus"]) == (2, 8)  # numGpus 1 and num_cpus 4, per rank
    assert _groups(rs)["decode"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    # what the chart renders for GPUs is refused when the app is built: the ranks run on CPU over gloo only
    with pytest.raises(ValueError, match="device 'cuda' would need NCCL, which is not wired yet"):
        system_config(serve_config["applications"][-1]["args"], ENV)

    one_gpu = subprocess.run([helm, "template", "pdserve", str(CHART), "-f", str(GPU_POOLS),
                              *(a for s in sets[:2] for a in ("--set", s))], check=False, capture_output=True, text=True)
    assert one_gpu.returncode != 0
    assert ("decode: a replica takes numGpus x worker.tensor_parallel_size = 2 GPUs but the pod's "
            "resources.limits[nvidia.com/gpu] is 1: it would never be scheduled") in one_gpu.stderr, one_gpu.stderr


def test_the_gpu_example_takes_one_gpu_per_replica(render):
    rs = _rayservice(render([GPU_POOLS]))
    for deployment in _app(rs)["deployments"]:
        assert deployment["ray_actor_options"]["num_gpus"] == 1
        pod = _groups(rs)[deployment["name"]]["template"]["spec"]["containers"][0]
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_the_disaggregated_example_splits_prefill_over_two_ranks_and_decode_over_one(render):
    from pdserve.services.serve_builder import system_config

    rs = _rayservice(render([DISAGGREGATED_TP]))
    config = system_config(_app(rs)["args"], ENV)
    assert config.mode == "disaggregated"
    prefill, decode = config.worker("prefill"), config.worker("decode")
    assert (prefill.engine_config().tensor_parallel_size, decode.engine_config().tensor_parallel_size) == (2, 1)
    assert prefill.kv_handoff and decode.kv_handoff
    assert prefill.deployment_options()["ray_actor_options"]["num_cpus"] == 2.0
    assert _groups(rs)["prefill"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_ranks_on_a_role_that_hands_kv_off_render_and_zero_is_refused(helm, role):
    sets = [f"{role}.worker.tensor_parallel_size=2", f"{role}.worker.kv_cache_dtype=int8"]
    result = subprocess.run([helm, "template", "pdserve", str(CHART), *(a for s in sets for a in ("--set", s))],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    zero = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", f"{role}.worker.tensor_parallel_size=0"],
                          check=False, capture_output=True, text=True)
    assert zero.returncode != 0 and f"/{role}/worker/tensor_parallel_size': minimum: got 0, want 1" in zero.stderr
