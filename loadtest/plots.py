"""PNG plots (matplotlib, Agg): attainment vs rate, TTFT/TPOT CDFs at one rate, throughput vs rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pdserve.loadtest.evaluate import TargetResult
from pdserve.loadtest.metrics import request_metrics
from pdserve.loadtest.slo import SLO


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colors(n: int) -> list:
    plt = _pyplot()
    return [plt.get_cmap("tab10")(i % 10) for i in range(n)]


def attainment_plot(targets: list[TargetResult], target_attainment: float, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for t, color in zip(targets, _colors(len(targets))):
        rates = sorted(t.sweep.points)
        ax.plot(rates, [100 * t.sweep.points[r] for r in rates], "o-", color=color, label=t.name)
        if t.sweep.goodput > 0:
            at_least = "≥ " if t.sweep.capped else ""
            ax.axvline(t.sweep.goodput, color=color, linestyle=":", alpha=0.8)
            ax.plot([t.sweep.goodput], [100 * t.sweep.points[t.sweep.goodput]], "*", color=color, markersize=16)
            ax.annotate(f"{at_least}{t.sweep.goodput:.2f} req/s", (t.sweep.goodput, 100 * target_attainment),
                        xytext=(4, -14 - 12 * targets.index(t)), textcoords="offset points", color=color, fontsize=9)
    ax.axhline(100 * target_attainment, color="grey", linestyle="--", label=f"{target_attainment:.0%} target")
    ax.set(xlabel="offered rate (req/s)", ylabel="SLO attainment (%)", ylim=(-3, 103),
           title="SLO attainment vs rate (★ = goodput: highest rate meeting the target)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdf(ax, values: list[float], color, label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.step(xs, np.arange(1, len(xs) + 1) / len(xs) * 100, where="post", color=color, label=label)


def latency_cdf_plot(targets: list[TargetResult], slo: SLO, rate: float, path: Path) -> Path:
    plt = _pyplot()
    fig, (ax_ttft, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.5))
    for t, color in zip(targets, _colors(len(targets))):
        run = t.runs.get(rate)
        if run is None:
            continue
        done = [m for m in map(request_metrics, run.results) if m is not None]
        _cdf(ax_ttft, [m.ttft_s * 1e3 for m in done], color, t.name)
        _cdf(ax_tpot, [m.tpot_s * 1e3 for m in done if m.tpot_s is not None], color, t.name)
    for ax, bound, metric in ((ax_ttft, slo.ttft_s, "TTFT"), (ax_tpot, slo.tpot_s, "TPOT")):
        ax.axvline(bound * 1e3, color="grey", linestyle="--", label=f"SLO {bound * 1e3:.0f} ms")
        ax.set(xlabel=f"{metric} (ms)", ylabel="completed requests (%)", title=f"{metric} CDF at {rate:g} req/s")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_plot(targets: list[TargetResult], path: Path) -> Path:
    plt = _pyplot()
    fig, (ax_req, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = 0.0
    for t, color in zip(targets, _colors(len(targets))):
        rates = sorted(t.runs)
        top = max([top, *rates])
        ax_req.plot(rates, [t.runs[r].summary.request_throughput for r in rates], "o-", color=color,
                    label=f"{t.name}: completed")
        ax_req.plot(rates, [t.goodput_at(r) for r in rates], "s--", color=color, alpha=0.7,
                    label=f"{t.name}: within SLO")
        ax_tok.plot(rates, [t.runs[r].summary.output_throughput for r in rates], "o-", color=color, label=t.name)
    ax_req.plot([0, top], [0, top], color="lightgrey", linewidth=1, label="offered")
    ax_req.set(xlabel="offered rate (req/s)", ylabel="req/s", title="request throughput and goodput")
    ax_tok.set(xlabel="offered rate (req/s)", ylabel="output tokens/s", title="output token throughput")
    for ax in (ax_req, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(targets: list[TargetResult], slo: SLO, cdf_rate: float, target_attainment: float,
                out_dir: Path) -> list[Path]:
    return [
        attainment_plot(targets, target_attainment, out_dir / "attainment_vs_rate.png"),
        latency_cdf_plot(targets, slo, cdf_rate, out_dir / "latency_cdf.png"),
        throughput_plot(targets, out_dir / "throughput_vs_rate.png"),
    ]
