"""The committed loadtest/results/simulator-validation.json is what its command gives now: every scenario's
figures, predicted and measured, as `pdserve-loadtest validate ... --write` computes them from the committed
live reports. A change to the model that moves a prediction fails here until the file is regenerated (and its
figures in docs/simulator.md and README.md with it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main

REPO = Path(__file__).resolve().parents[3]
COMMITTED = REPO / "loadtest/results/simulator-validation.json"


def test_the_committed_validation_is_what_validate_gives(monkeypatch, capsys):
    committed = json.loads(COMMITTED.read_text(encoding="utf-8"))
    monkeypatch.chdir(REPO)
    assert loadtest_main(["validate", *committed, "--json"]) == 0
    now = json.loads(capsys.readouterr().out)
    for name, row in committed.items():
        assert now[name]["max_abs_rel_error"] == pytest.approx(row["max_abs_rel_error"], rel=1e-9), name
        assert set(now[name]["figures"]) == set(row["figures"]), name
        for key, figure in row["figures"].items():
            for side in ("predicted", "measured"):
                assert now[name]["figures"][key][side] == pytest.approx(figure[side], rel=1e-9), (name, key, side)
