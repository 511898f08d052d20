"""`<role>.autoscaling.policy: slo` renders into each role's SystemConfig (not a Serve override), where it
becomes the deployment's custom autoscaling policy; settings that cannot work are refused, naming the field."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
AUTOSCALING = CHART / "ci" / "autoscaling-values.yaml"


def _serve_config(render, values=(), sets=()):
    (rs,) = [o for o in render(list(values), list(sets)) if o["kind"] == "RayService"]
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def test_the_autoscaling_example_scales_prefill_and_decode_on_the_slo_policy(render):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from pdserve.autoscale.serve_policy import POLICY_PATH, SLORolePolicy
    from pdserve.services.serve_builder import system_config

    serve_config = _serve_config(render, [AUTOSCALING])
    ServeDeploySchema.model_validate(serve_config)
    app = serve_config["applications"][-1]
    overridden = {d["name"]: d for d in app.get("deployments", [])}
    assert "autoscaling_config" in overridden["router"]  # the router stays on target_ongoing_requests
    assert all("autoscaling_config" not in overridden.get(role, {}) for role in ("prefill", "decode"))
    config = system_config(app["args"], {"PDSERVE_REDIS_PASSWORD": "x"})
    for role, most in (("prefill", 8), ("decode", 16)):
        options = config.worker(role).deployment_options()
        assert "num_replicas" not in options
        serve_autoscaling = AutoscalingConfig(**options["autoscaling_config"])  # Serve's own validation
        assert (serve_autoscaling.min_replicas, serve_autoscaling.max_replicas) == (1, most)
        assert serve_autoscaling.policy.policy_function == POLICY_PATH
        assert (serve_autoscaling.upscale_delay_s, serve_autoscaling.downscale_delay_s) == (0, 0)
        policy = SLORolePolicy(**serve_autoscaling.policy.policy_kwargs)
        assert (policy.config.upscale_delay_s, policy.config.cooldown_s) == (30, 300)
        assert options["graceful_shutdown_timeout_s"] > config.worker(role).autoscaling.drain_timeout_s


def test_default_values_keep_serve_replicas(render):
    app = _serve_config(render)["applications"][-1]
    assert "autoscaling" not in app["args"]["prefill"] and "autoscaling" not in app["args"]["decode"]
    on = _serve_config(render, sets=["decode.autoscaling.enabled=true"])["applications"][-1]
    (decode,) = [d for d in on["deployments"] if d["name"] == "decode"]
    assert decode["autoscaling_config"]["target_ongoing_requests"] == 32  # policy ongoing: as before


def test_an_unknown_policy_is_refused_by_the_schema(helm):
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "prefill.autoscaling.policy=magic"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "policy" in result.stderr, result.stderr


@pytest.mark.parametrize("sets, message", [
    (["prefill.autoscaling.minReplicas=3", "prefill.autoscaling.maxReplicas=2"],
     "prefill.autoscaling: min_replicas: 3 is above max_replicas 2"),
    (["decode.autoscaling.slo.tpot_slo_s=0.001"], "decode: autoscaling.tpot_slo_s: 0.001 s"),
    (["prefill.autoscaling.slo.ttft_slo_s=0.001"], "prefill: autoscaling.ttft_slo_s: 0.001 s"),
    (["decode.autoscaling.slo.profile=null"], "decode.autoscaling: profile_path: the slo policy needs a latency profile"),
])
def test_settings_that_cannot_work_are_refused_when_the_config_loads(render, sets, message):
    from pdserve.services.app import config_errors
    from pdserve.services.serve_builder import system_config

    app = _serve_config(render, [AUTOSCALING], sets)["applications"][-1]
    with pytest.raises(ValidationError) as info:
        system_config(app["args"], {"PDSERVE_REDIS_PASSWORD": "x"})
    assert any(line.startswith(message) for line in config_errors(info.value)), config_errors(info.value)
