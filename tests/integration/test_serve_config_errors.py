"""`pdserve serve --config system.yaml`, the console script as users run it, refuses a bad file with exit
code 2 and the key's path on stderr, before it starts Redis or Ray (nothing on stdout, no cleanup)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

PDSERVE = Path(sys.executable).with_name("pdserve")


def _serve(config: Path) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run([str(PDSERVE), "serve", "--config", config.name], cwd=config.parent,
                          capture_output=True, text=True, timeout=60)
    print(f"pdserve serve --config {config.name}: rc {done.returncode} in {time.monotonic() - started:.2f} s")
    return done


@pytest.mark.parametrize(("text", "message"), [
    ("model: tiny\ndecode:\n  max_num_seqz: 8\n",
     "pdserve serve: system.yaml: decode.max_num_seqz: unknown key (did you mean max_num_seqs?)"),
    ("decode:\n  max_num_seqs: 0\n",
     "pdserve serve: system.yaml: decode.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
    ("router:\n  placement:\n    polcy: kv_aware\n",
     "pdserve serve: system.yaml: router.placement.polcy: unknown key (did you mean policy?)"),
    ("decode: {max_num_seqs: 8\n", "pdserve serve: system.yaml:2: invalid YAML: expected ',' or '}'"),
])
def test_a_bad_config_file_exits_2_naming_the_key(tmp_path, text, message):
    assert PDSERVE.exists(), "the console script is installed next to the interpreter"
    path = tmp_path / "system.yaml"
    path.write_text(text)
    done = _serve(path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(message), done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""  # no Redis started, no Ray, nothing to stop


def test_a_missing_config_file_exits_2(tmp_path):
    done = _serve(tmp_path / "system.yaml")
    assert done.returncode == 2
    assert done.stderr == "pdserve serve: system.yaml: cannot read: No such file or directory\n"
