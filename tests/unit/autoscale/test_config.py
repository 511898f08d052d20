"""Autoscaling settings that cannot work are refused when they load, naming the field."""

from __future__ import annotations

import pytest
from pdserve.autoscale import AutoscaleConfig, RoleBounds
from pdserve.bench.placement import h100_8b_profile


@pytest.mark.parametrize(("settings", "field"), [
    ({"prefill": RoleBounds(5, 2)}, "autoscale.prefill.min_replicas"),
    ({"decode": RoleBounds(0, 0)}, "autoscale.decode.max_replicas"),
    ({"decode": RoleBounds(-1, 2)}, "autoscale.decode.min_replicas"),
    ({"upscale_delay_s": -1.0}, "autoscale.upscale_delay_s"),
    ({"downscale_delay_s": -5.0}, "autoscale.downscale_delay_s"),
    ({"cooldown_s": float("nan")}, "autoscale.cooldown_s"),
    ({"target_attainment": 0.0}, "autoscale.target_attainment"),
    ({"target_attainment": 1.5}, "autoscale.target_attainment"),
    ({"kv_target_usage": 1.2}, "autoscale.kv_target_usage"),
    ({"policy": "magic"}, "autoscale.policy"),
    ({"ttft_slo_s": 0.0}, "autoscale.ttft_slo_s"),
    ({"downscale_band": 1.0}, "autoscale.downscale_band"),
    ({"max_step": 0}, "autoscale.max_step"),
])
def test_impossible_settings_are_refused_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        AutoscaleConfig(**settings)


def test_target_one_is_allowed():
    assert AutoscaleConfig(target_attainment=1.0).target_attainment == 1.0


def test_from_dict_refuses_unknown_keys_and_builds_bounds():
    with pytest.raises(ValueError, match=r"^autoscale.upscale_dealy_s:"):
        AutoscaleConfig.from_dict({"upscale_dealy_s": 3})
    with pytest.raises(ValueError, match=r"^autoscale.decode.max:"):
        AutoscaleConfig.from_dict({"decode": {"max": 3}})
    with pytest.raises(ValueError, match=r"^autoscale.decode.min_replicas:"):
        AutoscaleConfig.from_dict({"decode": {"min_replicas": 4, "max_replicas": 3}})
    assert AutoscaleConfig.from_dict({"prefill": {"max_replicas": 8}}).prefill == RoleBounds(1, 8)


def test_slos_no_replica_count_can_meet_are_refused_against_the_profile():
    profile = h100_8b_profile()
    AutoscaleConfig(ttft_slo_s=1.0, tpot_slo_s=0.05).check_profile(profile)
    with pytest.raises(ValueError, match=r"^autoscale.tpot_slo_s:"):
        AutoscaleConfig(tpot_slo_s=0.004).check_profile(profile)  # a batch-1 step takes 4.8 ms
    with pytest.raises(ValueError, match=r"^autoscale.ttft_slo_s:"):
        AutoscaleConfig(ttft_slo_s=0.001).check_profile(profile)


def test_the_policy_imports_without_ray_or_torch():
    import subprocess
    import sys

    code = "import sys, pdserve.autoscale; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
