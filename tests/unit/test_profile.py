"""`pdserve profile`: a small measured grid on tiny, and the CLI's profile file (roles merge)."""

from __future__ import annotations

import json

import pdserve.bench.profile as profile_module
from pdserve.services.cli import main
from pdserve.config import CacheConfig, EngineConfig
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel


def test_profile_fits_a_small_grid_on_tiny():
    config = EngineConfig(model="tiny", device="cpu", dtype="float32", cache=CacheConfig(block_size=16))
    model = profile_module.profile(config, prompt_lengths=(16, 64, 128), batch_sizes=(1, 4),
                                   context_lengths=(16, 64), cached_prefixes=(64,), repeats=2, decode_steps=2)
    # one sample per grid point: 3 fresh prompts + 2 with the 64-token prefix cached; 2 batch sizes x 2 contexts
    assert model.prefill.error.num_samples == 5
    assert model.decode.error.num_samples == 4
    assert model.kv_bytes_per_token == 2 * 4 * 4 * 32 * 4
    assert model.prefill_time_s(128) > 0 and model.decode_step_s(4, 256) > 0
    assert model.transfers == {}


def test_cli_writes_and_extends_a_profile_file(tmp_path, monkeypatch, capsys):
    fitted = LatencyModel(PrefillModel(0.01, 1e-4, 0.0), DecodeModel(0.02, 1e-3, 1e-6), kv_bytes_per_token=64)
    monkeypatch.setattr(profile_module, "run", lambda *args, **kwargs: fitted)
    out = tmp_path / "profile.json"
    assert main(["profile", "--quick", "--role", "prefill", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["role"] == "prefill" and printed["fit_errors"] == {"prefill": None, "decode": None}
    assert main(["profile", "--quick", "--role", "decode", "--out", str(out)]) == 0
    saved = LatencyProfile.load(out)
    assert sorted(saved.models) == ["decode", "prefill"]
    assert saved.command == f"pdserve profile --quick --role decode --out {out}"
    assert saved.for_role("decode") == fitted
