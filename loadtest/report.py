"""summary.json and summary.md: goodput per target, who wins and by how much, attainment by rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdserve.loadtest.evaluate import TargetResult
from pdserve.loadtest.machine import SLOW_RATIO, describe
from pdserve.loadtest.provenance import header_line
from pdserve.loadtest.metrics import prefix_hit_rate
from pdserve.loadtest.slo import SLO


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}×"


def _fmt(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def winner_of(targets: list[TargetResult]) -> TargetResult | None:
    """The target with the highest goodput; None on a tie at the top or when none met the target."""
    ranked = sorted(targets, key=lambda t: t.sweep.goodput, reverse=True)
    if ranked[0].sweep.goodput <= 0 or (len(ranked) > 1 and ranked[0].sweep.goodput == ranked[1].sweep.goodput):
        return None
    return ranked[0]


def ttft_p50_ms(t: TargetResult, rate: float) -> float | None:
    run = t.runs.get(rate)
    return None if run is None else run.summary.ttft_ms["p50"]


def overall_prefix_hit_rate(t: TargetResult) -> float | None:
    """Over every run of the target's sweep (the rates a sweep visits differ between targets)."""
    return prefix_hit_rate([r for run in t.runs.values() for r in run.results])


def prefix_hit_rate_at(t: TargetResult, rate: float) -> float | None:
    run = t.runs.get(rate)
    return None if run is None else run.summary.prefix_hit_rate


def decoding_at(t: TargetResult, rate: float) -> float | None:
    run = t.runs.get(rate)
    return None if run is None else run.summary.decoding_concurrency


def summary_dict(targets: list[TargetResult], slo: SLO, cdf_rate: float, target_attainment: float,
                 meta: dict[str, Any]) -> dict[str, Any]:
    baseline, winner = targets[0], winner_of(targets)
    out_targets = []
    base_ttft = ttft_p50_ms(baseline, cdf_rate)
    for t in targets:
        ttft = ttft_p50_ms(t, cdf_rate)
        points = [{"rate": r, "attainment": t.sweep.points[r], "goodput": t.goodput_at(r),
                   "replica_cpu_s": t.cpu.get(r), "host_cpu_s": t.host_cpu.get(r), "engine_steps": t.steps.get(r),
                   "summary": t.runs[r].summary.to_dict()}
                  for r in sorted(t.sweep.points)]
        out_targets.append({
            "name": t.name, "system": t.system, "idle": t.idle.to_dict() if t.idle else None,
            "batch_probe": t.batch_probe.to_dict() if t.batch_probe else None,
            "serving_probe": t.serving_probe.to_dict() if t.serving_probe else None,
            "goodput": t.sweep.goodput, "goodput_capped": t.sweep.capped, "bracket": list(t.sweep.bracket),
            "goodput_vs_baseline": ratio(t.sweep.goodput, baseline.sweep.goodput),
            "prefix_hit_rate": overall_prefix_hit_rate(t),
            "prefix_hit_rate_at_cdf_rate": prefix_hit_rate_at(t, cdf_rate), "ttft_p50_ms": ttft,
            "ttft_p50_vs_baseline": ratio(ttft, base_ttft) if ttft is not None and base_ttft else None,
            "replica_cpu_s_per_request_at_cdf_rate": t.cpu_per_request(cdf_rate), "quiet_cpu_s": t.quiet_cpu,
            "machine": t.machine,
            "points": points,
        })
    return {
        **meta, "slo": slo.to_dict(), "attainment_target": target_attainment, "cdf_rate": cdf_rate,
        "targets": out_targets,
        "comparison": {
            "baseline": baseline.name, "winner": winner.name if winner else None,
            "winner_vs": {t.name: ratio(winner.sweep.goodput, t.sweep.goodput) for t in targets if t is not winner}
            if winner else {},
        },
    }


def _slo_origin(meta: dict[str, Any]) -> str:
    spec, reference = meta.get("slo_spec") or {}, meta.get("slo_reference")
    parts = [f"{spec[f'{m}_factor']:g}× idle {m.upper()}" for m in ("ttft", "tpot") if spec.get(f"{m}_factor")]
    return f" ({' and '.join(parts)} of `{reference}`)" if parts and reference else ""


def _machine_lines(checks) -> list[str]:
    """One line per profile the machine was compared with (pdserve.loadtest.machine)."""
    lines = []
    for c in checks:
        verdict = {"matches": f"it matches the profile (within {SLOW_RATIO}×)"}.get(
            c["verdict"], f"**{c['verdict']} than the profile: absolute figures here do not compare with runs on a "
                          "machine that matches it**")
        lines.append(f"- machine: {describe(c)}; {verdict}")
    return lines


def _drift_lines(targets: list[TargetResult]) -> list[str]:
    """The machine check before each target, against the first profile: its speed can move between
    targets, and then so do their goodputs, whatever the system under test does."""
    measured = [(t.name, t.machine[0]) for t in targets if t.machine]
    if len(measured) < 2:
        return []
    slowest = [check["slowest_ratio"] for _, check in measured]
    moved = max(slowest) / min(slowest)
    each = ", ".join(f"`{name}` {check['slowest_ratio']:.2f}×" for name, check in measured)
    verdict = (f"**it moved {moved:.2f}× between targets, more than {SLOW_RATIO}×: their goodputs do not compare**"
               if moved > SLOW_RATIO else f"within {moved:.2f}× of each other")
    return [f"- machine before each target (worst ratio to `{measured[0][1]['profile_path']}`): {each}; {verdict}"]


def _bound_lines(bound: dict[str, Any] | None) -> list[str]:
    """`pdserve-loadtest bound` of the scenario's trace: what any placement could save on it."""
    if not bound:
        return []
    hits = bound["prefix_hit_rate"]
    lines = ["", "## Placement ceiling of the trace", "",
             (f"`pdserve-loadtest bound` on this trace over {bound['num_replicas']} replicas: one cache that has "
              f"seen every earlier request (the ceiling of any placement) caches {_pct(hits['ceiling'])} of "
              f"prompt tokens, a replica drawn at random (cache-blind) {_pct(hits['cache_blind'])}.")]
    rows = bound.get("model_time_per_request")
    if rows:
        lines += [("Priced with the first target's profile, the most a prefix-aware placement can raise a "
                   "compute-bound pool's rate (cache-blind model time per request over the ceiling's), by the "
                   "decode batch each replica runs; the requests decoding above, over the replicas, say which "
                   "column applies."), "",
                  "| decode batch | " + " | ".join(str(r["decode_batch"]) for r in rows) + " |",
                  "|---|" + "---:|" * len(rows),
                  "| capacity ratio | " + " | ".join(_fmt_ratio(r["capacity_ratio"]) for r in rows) + " |"]
    return lines


def _cpu_lines(targets: list[TargetResult], cdf_rate: float) -> list[str]:
    per_request = {t.name: t.cpu_per_request(cdf_rate) for t in targets}
    if not any(per_request.values()):
        return []
    deployments = sorted({d for cpu in per_request.values() if cpu for d in cpu if d != "all"})
    base = per_request[targets[0].name]
    lines = ["", f"## Replica CPU per completed request at {cdf_rate:g} req/s", "",
             ("CPU seconds the app's replica processes burned during the run (utime + stime from /proc) over "
              "the requests it completed. Where replicas share the machine's cores, this is what bounds "
              "the rate it can sustain."), "",
             "| target | " + " | ".join(f"`{d}` (s)" for d in deployments) + f" | all (s) | vs `{targets[0].name}` |",
             "|---|" + "---:|" * (len(deployments) + 2)]
    for t in targets:
        cpu = per_request[t.name]
        if not cpu:
            continue
        cells = [_fmt(cpu.get(d), 3) for d in deployments]
        vs = _fmt_ratio(ratio(cpu["all"], base["all"])) if base else "n/a"
        lines.append(f"| `{t.name}` | " + " | ".join(cells) + f" | {cpu['all']:.3f} | {vs} |")
    return lines


def _goodput_text(t: TargetResult) -> str:
    return ("≥ " if t.sweep.capped else "") + f"{t.sweep.goodput:.3g}"


def summary_markdown(targets: list[TargetResult], slo: SLO, cdf_rate: float, meta: dict[str, Any],
                     target_attainment: float, plots: list[Path]) -> str:
    baseline, winner = targets[0], winner_of(targets)
    lines = [f"# Load test: {meta.get('scenario', 'run')}", ""]
    if meta.get("description"):
        lines += [meta["description"].strip(), ""]
    lines += [
        header_line(meta.get("provenance")),
        f"- model: `{meta.get('model', '?')}`",
        f"- workload: `{json.dumps(meta.get('workload', {}))}`",
        f"- SLO: TTFT ≤ {slo.ttft_s * 1e3:.0f} ms and TPOT ≤ {slo.tpot_s * 1e3:.1f} ms"
        + _slo_origin(meta),
        f"- goodput: the highest offered rate with SLO attainment ≥ {target_attainment:.0%}",
        *_machine_lines(meta.get("machine") or ()), *_drift_lines(targets), "",
        "## Verdict", "",
    ]
    if len(targets) == 1:
        lines.append(f"`{baseline.name}`: goodput {_goodput_text(baseline)} req/s.")
    elif max(t.sweep.goodput for t in targets) <= 0:
        lines.append(f"No target reached {target_attainment:.0%} attainment at the lowest rate tried.")
    elif winner is None:
        top = max(t.sweep.goodput for t in targets)
        tied = ", ".join(f"`{t.name}`" for t in targets if t.sweep.goodput == top)
        lines.append(f"Tie: {tied} reach the same goodput ({top:.3g} req/s) within the sweep's resolution.")
    else:
        others = ", ".join(
            f"{_fmt_ratio(ratio(winner.sweep.goodput, t.sweep.goodput))} `{t.name}` ({_goodput_text(t)} req/s)"
            if t.sweep.goodput > 0 else f"`{t.name}` missed the target even at the lowest rate"
            for t in targets if t is not winner)
        lines.append(f"**`{winner.name}` wins** with goodput {_goodput_text(winner)} req/s"
                     + (f": {others}." if others else "."))
        if any(t.sweep.capped for t in targets):
            lines.append("")
            lines.append("≥: every rate tried met the target; the true goodput is higher (raise sweep.rates).")
    lines += ["", "## Goodput", "",
              f"| target | goodput (req/s) | vs `{baseline.name}` | idle TTFT (ms) | idle TPOT (ms) |",
              "|---|---:|---:|---:|---:|"]
    for t in targets:
        idle = t.idle.to_dict() if t.idle else {}
        lines.append(f"| `{t.name}` | {_goodput_text(t)} | {_fmt_ratio(ratio(t.sweep.goodput, baseline.sweep.goodput))}"
                     f" | {_fmt(idle.get('ttft_ms'))} | {_fmt(idle.get('tpot_ms'), 1)} |")
    rates = sorted({r for t in targets for r in t.sweep.points})
    lines += ["", "## SLO attainment and goodput (within-SLO req/s) by offered rate", "",
              "| rate (req/s) | " + " | ".join(f"`{t.name}`" for t in targets) + " |",
              "|---:|" + "---:|" * len(targets)]
    for r in rates:
        cells = [f"{t.sweep.points[r]:.0%} ({t.goodput_at(r):.2f})" if r in t.sweep.points else "" for t in targets]
        lines.append(f"| {r:.3g} | " + " | ".join(cells) + " |")
    lines += ["", f"## Latency at {cdf_rate:g} req/s", "",
              ("| target | attainment | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p99 (ms) "
               "| completed / total | rejected | errors | cancelled |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in targets:
        run = t.runs.get(cdf_rate)
        if run is None:
            continue
        s, c = run.summary, run.summary.counts
        lines.append(
            f"| `{t.name}` | {t.sweep.points[cdf_rate]:.0%} "
            f"| {' / '.join(_fmt(s.ttft_ms[k]) for k in ('p50', 'p90', 'p99'))} "
            f"| {' / '.join(_fmt(s.tpot_ms[k], 1) for k in ('p50', 'p90', 'p99'))} | {_fmt(s.itl_ms['p99'], 1)} "
            f"| {c.completed} / {c.total} | {c.rejected} | {c.errors} | {c.cancelled} |")
    if any(overall_prefix_hit_rate(t) for t in targets):
        base_ttft = ttft_p50_ms(baseline, cdf_rate)
        lines += ["", "## Prefix cache", "",
                  ("Prompt tokens the server reported cached (`usage.prompt_tokens_details.cached_tokens`) over "
                   "prompt tokens of completed requests; a TTFT p50 ratio below 1: earlier first tokens than "
                   f"`{baseline.name}`. Requests decoding: the mean number between their first token and their "
                   "end, all replicas together (the decode batch `pdserve-loadtest bound` prices at)."), "",
                  (f"| target | prefix hit rate (all runs) | at {cdf_rate:g} req/s "
                   f"| TTFT p50 at {cdf_rate:g} req/s (ms) | TTFT p50 vs `{baseline.name}` "
                   f"| requests decoding at {cdf_rate:g} req/s |"),
                  "|---|---:|---:|---:|---:|---:|"]
        for t in targets:
            ttft = ttft_p50_ms(t, cdf_rate)
            lines.append(f"| `{t.name}` | {_pct(overall_prefix_hit_rate(t))} "
                         f"| {_pct(prefix_hit_rate_at(t, cdf_rate))} | {_fmt(ttft)} "
                         f"| {_fmt_ratio(ratio(ttft, base_ttft) if ttft is not None and base_ttft else None)} "
                         f"| {_fmt(decoding_at(t, cdf_rate), 2)} |")
    lines += _bound_lines(meta.get("placement_bound"))
    lines += _cpu_lines(targets, cdf_rate)
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def write_report(out_dir: Path, targets: list[TargetResult], slo: SLO, cdf_rate: float, target_attainment: float,
                 meta: dict[str, Any]) -> dict[str, Any]:
    from pdserve.loadtest.plots import write_plots

    plots = write_plots(targets, slo, cdf_rate, target_attainment, out_dir)
    summary = summary_dict(targets, slo, cdf_rate, target_attainment, meta)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out_dir / "summary.md").write_text(summary_markdown(targets, slo, cdf_rate, meta, target_attainment, plots),
                                        encoding="utf-8")
    return summary
