"""What `pdserve serve` checks of a validated SystemConfig before Redis or Ray starts: per role, what the
model can be served as (a quantization, a tensor-parallel split). Torch is imported only when a role asks
for something to check."""

from __future__ import annotations

import subprocess
import sys


class ConfigError(ValueError):
    """Settings `pdserve serve` refuses before starting anything: one line per problem, each naming its key."""


def _roles(config) -> tuple[str, ...]:
    return ("prefill", "decode") if config.mode == "disaggregated" else ("decode",)


def quantizations(config) -> dict[str, str]:
    """role -> the weight quantization its replicas serve (the roles this mode runs)."""
    from pdserve.services.worker import WorkerConfig

    default = WorkerConfig.model_fields["quantization"].default
    return {role: getattr(config, role).get("quantization", default) for role in _roles(config)}


def tensor_parallel_sizes(config) -> dict[str, int]:
    """role -> the ranks of each of its replicas (the roles this mode runs)."""
    return {role: getattr(config, role).get("tensor_parallel_size", 1) for role in _roles(config)}


def check_quantization(config) -> None:
    """Refuses, before Redis or Ray starts, a quantization a role's model cannot be served in (the
    tensor and the reason); ConfigError."""
    QuantizationCheck(config).result()


class QuantizationCheck:
    """check_quantization in a child process (torch and the model's meta build would otherwise stay in
    `pdserve serve`'s memory, ~300 MB), started on construction: the caller goes on (importing Ray) while
    torch loads there, and `result` waits for the verdict."""

    def __init__(self, config) -> None:
        sizes = tensor_parallel_sizes(config)
        # auto on tensor-parallel ranks serves the model dtype (pdserve.config.EngineConfig.weight_quantization)
        asked = {(getattr(config, role).get("model", config.model), q) for role, q in quantizations(config).items()
                 if not (q == "auto" and sizes[role] > 1)}
        self.pairs = sorted((model, q) for model, q in asked if q != "none")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.models.served", *(x for pair in self.pairs for x in pair)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) if self.pairs else None

    def result(self) -> None:
        """Returns when the check passed; ConfigError naming the model, the tensor and the reason."""
        if self.process is None:
            return
        _, stderr = self.process.communicate()
        code = self.process.returncode
        if code == 0:
            return
        lines = stderr.strip().splitlines() or [f"exit code {code}"]
        if code != 2:
            raise ConfigError(f"quantization check of {self.pairs} failed: {lines[-1]}")
        index, what, reason = lines[-1].split(" ", 2)
        model, quantization = self.pairs[int(index)]
        raise ConfigError(reason if what == "model" else f"quantization {quantization} of {model}: {reason}")

    def cancel(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def check_tensor_parallel(config) -> None:
    """Refuses, before Redis or Ray starts, a tensor_parallel_size a role's model cannot be split into (more
    ranks than attention heads, query heads that do not group over the KV heads); ConfigError."""
    asked = {(getattr(config, role).get("model", config.model), n)
             for role, n in tensor_parallel_sizes(config).items() if n > 1}
    if not asked:
        return
    from pdserve.models.config import load_model_config
    from pdserve.models.resolve import resolve_model_path
    from pdserve.models.tensor_parallel import check_tensor_parallel as check

    for model, size in sorted(asked):
        try:
            check(load_model_config(resolve_model_path(model)), size)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(f"tensor_parallel_size {size} of {model}: {exc}") from None
