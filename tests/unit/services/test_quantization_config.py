"""Weight quantization per role: validated where the config is read (named by its key), set on both roles by
`pdserve serve --quantization`, passed to each role's engine, and refused before anything starts when the
device or the model cannot serve it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from pdserve.services.app import SystemConfig, config_errors
from pdserve.services.cli import serve_parser
from pdserve.services.serve import ConfigError, check_quantization, quantizations, run, system_config
from pdserve.services.serve_checks import QuantizationCheck
from pdserve.services.worker import WorkerConfig


def _errors(raw: dict) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        SystemConfig.model_validate(raw)
    return config_errors(caught.value)


def test_each_role_sets_its_own_and_it_reaches_the_engine():
    config = SystemConfig(prefill={"quantization": "int8"}, decode={"quantization": "auto", "dtype": "auto"})
    assert config.worker("prefill").engine_config().quantization == "int8"
    decode = config.worker("decode").engine_config()
    assert (decode.quantization, decode.dtype) == ("auto", "auto")
    assert SystemConfig().worker("decode").engine_config().quantization == "auto"  # the serving default
    assert quantizations(config) == {"prefill": "int8", "decode": "auto"}
    assert quantizations(SystemConfig(mode="colocated", decode={"quantization": "int4"})) == {"decode": "int4"}


def test_an_unknown_value_is_refused_naming_the_key():
    (line,) = _errors({"decode": {"quantization": "int3"}})
    assert line.startswith("decode.quantization: Input should be 'none', 'auto', 'int8', 'int4' or 'fp8'"), line


def test_fp8_on_cpu_is_refused_by_the_config_and_accepted_for_cuda():
    (line,) = _errors({"prefill": {"quantization": "fp8"}})
    assert line == ("prefill.quantization: fp8 weights need a GPU with FP8; device 'cpu' has none "
                    "(int8 or int4 run on CPU) (got 'fp8')")
    assert WorkerConfig(device="cuda", quantization="fp8").quantization == "fp8"


def test_the_flag_sets_both_roles_over_the_file(tmp_path):
    path = tmp_path / "system.yaml"
    path.write_text("prefill: {quantization: int8}\ndecode: {quantization: none, max_num_seqs: 8}\n")
    from_file = system_config(serve_parser().parse_args(["--config", str(path)]), None)
    assert quantizations(from_file) == {"prefill": "int8", "decode": "none"}
    flagged = system_config(serve_parser().parse_args(["--config", str(path), "--quantization", "auto"]), None)
    assert quantizations(flagged) == {"prefill": "auto", "decode": "auto"}
    assert flagged.worker("decode").max_num_seqs == 8
    assert quantizations(system_config(serve_parser().parse_args([]), None)) == {"prefill": "auto", "decode": "auto"}


def test_a_shape_the_model_cannot_take_is_refused_before_ray_with_the_tensor(capsys):
    config = system_config(serve_parser().parse_args(["--model", "tiny", "--quantization", "int4"]), None)
    with pytest.raises(ConfigError, match="quantization int4 of tiny: tensor 'model.layers.0.mlp.down_proj.weight': "
                                          "in_features 688 is not a multiple of the quantization group 32"):
        check_quantization(config)
    check_quantization(system_config(serve_parser().parse_args(["--model", "tiny", "--quantization", "int8"]), None))
    assert run(serve_parser().parse_args(["--model", "tiny", "--quantization", "int4", "--port", "1"])) == 2
    err = capsys.readouterr().err
    assert "pdserve serve: quantization int4 of tiny: tensor 'model.layers.0.mlp.down_proj.weight'" in err


def test_pdserve_serve_fp8_on_cpu_exits_at_once_naming_the_keys():
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "serve", "--model", "tiny",
                           "--quantization", "fp8"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "pdserve serve: prefill.quantization: fp8 weights need a GPU with FP8" in done.stderr
    assert "pdserve serve: decode.quantization: fp8 weights need a GPU with FP8" in done.stderr
    assert "pdserve is serving" not in done.stdout


def test_a_missing_model_is_refused_by_the_default_check_naming_the_model(capsys):
    """The default (auto) checks the model in a child process: a model that is not there is named as such,
    not as a quantization problem."""
    assert run(serve_parser().parse_args(["--model", "/nonexistent/x.gguf", "--port", "1"])) == 2
    err = capsys.readouterr().err
    assert "pdserve serve: model '/nonexistent/x.gguf' is not 'tiny'" in err, err


def _children() -> set[int]:
    """This process's child processes, running or exited and not yet reaped."""
    return {int(pid) for pid in Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split()}


def test_the_check_runs_beside_the_caller_and_a_cancel_ends_and_reaps_it():
    """`pdserve serve` starts the check's child process, imports Ray meanwhile, then waits for the verdict;
    refusing on something else first (a taken port, Ctrl-C) cancels it."""
    config = system_config(serve_parser().parse_args([]), None)
    before = _children()
    check = QuantizationCheck(config)
    assert check.process is not None and check.process.pid in _children() - before
    check.cancel()
    assert check.process.returncode is not None and _children() <= before
    passing = QuantizationCheck(config)
    passing.result()  # the default model's auto: nothing refused
    assert passing.process.returncode == 0 and _children() <= before
