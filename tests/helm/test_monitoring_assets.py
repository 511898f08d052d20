"""The chart's monitoring assets: the alert rules (rules/pdserve-alerts.yaml) through a real promtool
(`check rules`, the unit tests beside them, a healthy system on which every alert's value expression
returns a series and none fires), their runbooks (docs/alerts.md), the Grafana dashboards (dashboards/)
and the PrometheusRule and ConfigMaps the chart renders from them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHART = ROOT / "deploy" / "helm" / "pdserve"
RULES = CHART / "rules" / "pdserve-alerts.yaml"
RULE_TESTS = CHART / "rules" / "pdserve-alerts.test.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
ALERTS_DOC = ROOT / "docs" / "alerts.md"
RUNBOOK_BASE = "https://github.com/pdserve/pdserve/blob/main/docs/alerts.md"
SEVERITIES = {"critical", "warning", "info"}
K8S_VERSION = "1.35.0"
# what Grafana substitutes in a panel's query before Prometheus sees it; nothing else may appear
GRAFANA_VARIABLES = {"$replica": ".*"}
REPLICAS = ("p1", "d1")  # the replicas of HEALTHY below, each a value the replica variable may take


def _rule_file() -> dict:
    return yaml.safe_load(RULES.read_text())


def _alerts() -> list[dict]:
    return [rule for group in _rule_file()["groups"] for rule in group["rules"] if "alert" in rule]


def _dashboards() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in DASHBOARDS}


def _panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return panels


def _dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every panel."""
    return [(name, panel["title"], target["expr"]) for name, d in _dashboards().items() for panel in _panels(d)
            for target in panel.get("targets", [])]


def _substitute(expr: str, **values: str) -> str:
    for variable, default in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, values.get(variable[1:], default))
    return expr


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=cwd, timeout=120)


# ---- the threshold convention: `<value expression> <op> <number>`, the comparison last and top-level

_NUMBER = re.compile(r"-?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_SET_OP = re.compile(r"(and|or|unless)\b")


def split_threshold(expr: str) -> tuple[str, str, float] | None:
    """(value expression, op, threshold) at the last comparison outside brackets and strings; None when
    there is none. Raises ValueError when what follows that comparison is not a plain number, or when a
    set operator (and, or, unless: looser than comparisons) is at the top level, above the comparison."""
    depth, quote, last, i, set_op = 0, None, None, 0, None
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and expr[i:i + 2] in ("==", "!=", ">=", "<="):
            last = (i, expr[i:i + 2])
            i += 2
            continue
        elif depth == 0 and c in "<>":
            last = (i, c)
        elif depth == 0 and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:")):
            set_op = set_op or _SET_OP.match(expr, i)
        i += 1
    if last is None:
        return None
    if set_op:
        raise ValueError(f"{set_op.group(1)!r} at the top level: the comparison is not the last operation")
    at, op = last
    threshold = expr[at + len(op):].strip()
    if not _NUMBER.fullmatch(threshold):
        raise ValueError(f"not a plain number after {op!r}: {threshold!r}")
    return expr[:at].strip(), op, float(threshold)


@pytest.mark.parametrize(("expr", "expected"), [
    ("x > 1", ("x", ">", 1.0)),
    ('sum(rate(x{a=~"b|c", d!="e"}[5m])) / 2 >= 0.5', ('sum(rate(x{a=~"b|c", d!="e"}[5m])) / 2', ">=", 0.5)),
    ("(a > 1 or b) == 0", ("(a > 1 or b)", "==", 0.0)),
    ('x{le="<1"} != -2', ('x{le="<1"}', "!=", -2.0)),
    ("(x or vector(0)) > 0.1", ("(x or vector(0))", ">", 0.1)),
    ("sort_desc(x) < 1e3", ("sort_desc(x)", "<", 1000.0)),
    ("absent(x)", None),
])
def test_split_threshold(expr, expected):
    assert split_threshold(expr) == expected


@pytest.mark.parametrize("expr", ["x > 1 and y", "x > y", "x > bool 1", "a > 1 and b < 2", "a or b > 1"])
def test_split_threshold_refuses_what_is_not_a_plain_threshold(expr):
    with pytest.raises(ValueError):
        split_threshold(expr)


# ---- the rule file


def test_promtool_check_rules(promtool):
    result = _run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{sum(len(g['rules']) for g in _rule_file()['groups'])} rules found" in result.stdout


def test_promtool_unit_tests_pass(promtool):
    result = _run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_rule_fails_its_unit_test(promtool, tmp_path):
    """The unit tests bite: raising one threshold out of reach makes them fail."""
    text = RULES.read_text()
    assert text.count("> 0.05\n") == 1
    (tmp_path / RULES.name).write_text(text.replace("> 0.05\n", "> 0.5\n"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = _run([promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path)
    assert result.returncode != 0 and "PdserveHighErrorRatio" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    names = [a["alert"] for a in _alerts()]
    assert len(names) == len(set(names)), names
    missing = {name: {True, False} - cases.get(name, set()) for name in names}
    assert not {k: v for k, v in missing.items() if v}, "alerts without a firing (True) / quiet (False) case"
    assert set(cases) <= set(names), set(cases) - set(names)


def test_groups_keep_alerts_and_recording_rules_apart():
    for group in _rule_file()["groups"]:
        kinds = {"alert" if "alert" in rule else "record" for rule in group["rules"]}
        assert len(kinds) == 1, group["name"]


def _doc_anchors() -> set[str]:
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{2,3} +(.+?) *$", ALERTS_DOC.read_text(), flags=re.MULTILINE)
    return {slugify(h, "-") for h in headings}


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_alert_conventions(alert):
    name = alert["alert"]
    assert re.fullmatch(r"Pdserve[A-Z][A-Za-z0-9]+", name)
    assert alert["labels"]["severity"] in SEVERITIES
    assert {"summary", "description", "runbook_url"} <= alert["annotations"].keys()
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}"
    assert name.lower() in _doc_anchors(), f"docs/alerts.md has no section {name}"
    expr = alert["expr"].strip()
    if re.match(r"absent(_over_time)?\(", expr):
        assert split_threshold(expr) is None
    else:
        assert split_threshold(expr) is not None, f"{name}: no threshold comparison"


def test_every_runbook_section_is_an_alert():
    sections = re.findall(r"^## +(Pdserve\w+) *$", ALERTS_DOC.read_text(), flags=re.MULTILINE)
    assert sorted(sections) == sorted(a["alert"] for a in _alerts())


# ---- metric names: every name the rules and dashboards use is one pdserve exports


def _exported_names() -> set[str]:
    names = set()
    for folder in ("shared", "services"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(re.findall(r"[\"'](pdserve_[a-z0-9_]+)[\"']", path.read_text()))
    return names


def _used_names(expr: str) -> set[str]:
    return set(re.findall(r"\bpdserve_[a-z0-9_]+", expr))


def test_every_metric_used_is_exported():
    exported = _exported_names()
    assert {"pdserve_fallbacks", "pdserve_slo_attainment"} <= exported

    def known(name: str) -> bool:
        return name in exported or any(
            name.endswith(s) and name.removesuffix(s) in exported for s in ("_total", "_bucket", "_sum", "_count"))

    exprs = [a["expr"] for a in _alerts()] + [e for _, _, e in _dashboard_exprs()]
    exprs += [v["definition"] for d in _dashboards().values() for v in d["templating"]["list"] if "definition" in v]
    unknown = sorted({n for e in exprs for n in _used_names(e) if not known(n)})
    assert not unknown, unknown


# ---- a healthy system under light load: every value expression returns a series, no alert fires


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    text = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def _healthy_series() -> list[dict[str, str]]:
    """What one scrape of the router gives a minute apart for 70 minutes of light load: a router, a
    prefill and a decode replica, a Redis tier, disaggregated requests over UCX, no failure yet (so no
    fallback, migration or 5xx series exists)."""
    target = {"job": "pdserve", "instance": "127.0.0.1:8000"}
    out = []

    def counter(per_min: float) -> str:
        return f"0+{per_min}x70"

    def gauge(value: float) -> str:
        return f"{value}x70"

    histograms = ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_seconds", "request_prefill_seconds", "request_decode_seconds")
    active = {"router": {"time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"},
              "prefill": {"request_queue_seconds", "request_prefill_seconds"},
              "decode": {"request_queue_seconds", "request_decode_seconds"}}
    for role, replica in (("router", "r1"), ("prefill", "p1"), ("decode", "d1")):
        labels = {**target, "role": role, "replica": replica, "model": "m"}
        for h in histograms:  # every replica has every histogram, at 0 where its role never observes
            n = 20 if h in active[role] else 0
            for le, share in (("0.1", 0.5), ("1.0", 0.9), ("+Inf", 1)):
                out.append(_series(f"pdserve_{h}_bucket", {**labels, "le": le}, counter(n * share)))
            out.append(_series(f"pdserve_{h}_sum", labels, counter(n * 0.2)))
            out.append(_series(f"pdserve_{h}_count", labels, counter(n)))
        prompt, generated = {"router": (600, 300), "prefill": (600, 0), "decode": (0, 300)}[role]
        out.append(_series("pdserve_prompt_tokens_total", labels, counter(prompt)))
        out.append(_series("pdserve_generation_tokens_total", labels, counter(generated)))
        for source in ("local", "redis"):
            out.append(_series("pdserve_prefix_cache_hit_tokens_total", {**labels, "source": source}, counter(0)))
        running = {"router": 0, "prefill": 1, "decode": 2}[role]
        out.append(_series("pdserve_requests_running", labels, gauge(running)))
        out.append(_series("pdserve_requests_waiting", labels, gauge(0)))
        out.append(_series("pdserve_kv_cache_usage_ratio", labels, gauge(0 if role == "router" else 0.2)))
        if role == "router":
            out.append(_series("pdserve_disaggregation_decisions_total",
                               {**labels, "decision": "disaggregate", "reason": "slo"}, counter(20)))
            for slo in ("ttft", "tpot", "both"):
                out.append(_series("pdserve_slo_attainment", {**labels, "slo": slo}, gauge(0.98)))
            for slo, target_s in (("ttft", 2.0), ("tpot", 0.2)):
                out.append(_series("pdserve_slo_target_seconds", {**labels, "slo": slo}, gauge(target_s)))
            out.append(_series("pdserve_slo_window_requests", labels, gauge(20)))
            out.append(_series("pdserve_slo_window_seconds", labels, gauge(60)))
            out.append(_series("pdserve_redis_up", labels, gauge(1)))
        else:
            for state in ("held", "exported"):
                out.append(_series("pdserve_kv_leases", {**labels, "state": state}, gauge(0)))
            out.append(_series("pdserve_kv_lease_oldest_seconds", labels, gauge(0)))
        if role == "decode":
            kv = {**labels, "transport": "ucx"}
            for name, le in (("seconds", "0.01"), ("bytes", "1048576.0")):
                out.append(_series(f"pdserve_kv_transfer_{name}_bucket", {**kv, "le": le}, counter(20)))
                out.append(_series(f"pdserve_kv_transfer_{name}_bucket", {**kv, "le": "+Inf"}, counter(20)))
                out.append(_series(f"pdserve_kv_transfer_{name}_count", kv, counter(20)))
            out.append(_series("pdserve_kv_transfer_seconds_sum", kv, counter(0.1)))
            out.append(_series("pdserve_kv_transfer_bytes_sum", kv, counter(20 * 500_000)))
    out.append(_series("pdserve_router_requests_total", {**target, "endpoint": "chat", "status": "200"}, counter(20)))
    out.append(_series("pdserve_router_inflight_requests", target, gauge(2)))
    for role in ("prefill", "decode"):
        out.append(_series("pdserve_router_live_replicas", {**target, "role": role}, gauge(1)))
    return out


def _healthy_test(tmp_path: Path, exprs: list[str], alerts: list[str]) -> Path:
    """A promtool test file over the healthy series: `group(expr)` is 1 (some series) for each expr, and
    no alert in `alerts` fires."""
    shutil.copy(RULES, tmp_path / RULES.name)
    test = {
        "interval": "1m",
        "input_series": _healthy_series(),
        "promql_expr_test": [{"expr": f"group({e})", "eval_time": "65m", "exp_samples": [{"labels": "{}", "value": 1}]}
                             for e in exprs],
        "alert_rule_test": [{"alertname": a, "eval_time": "65m", "exp_alerts": []} for a in alerts],
    }
    path = tmp_path / "healthy.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [RULES.name], "evaluation_interval": "1m", "tests": [test]},
                                   sort_keys=False))
    return path


def test_on_a_healthy_system_every_alert_value_returns_a_series_and_none_fires(promtool, tmp_path):
    values, absent = [], []
    for alert in _alerts():
        split = split_threshold(alert["expr"].strip())
        (absent if split is None else values).append(alert["expr"] if split is None else split[0])
    test = _healthy_test(tmp_path, values, [a["alert"] for a in _alerts()])
    spec = yaml.safe_load(test.read_text())
    # absent(...) over the healthy series is empty
    spec["tests"][0]["promql_expr_test"] += [{"expr": e, "eval_time": "65m", "exp_samples": []} for e in absent]
    test.write_text(yaml.safe_dump(spec, sort_keys=False))
    result = _run([promtool, "test", "rules", test.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_healthy_check_fails_on_an_expression_empty_on_a_healthy_system(promtool, tmp_path):
    """Without its `or 0 * ...` fallback the error ratio is empty while nothing fails: caught."""
    test = _healthy_test(tmp_path, ['sum(rate(pdserve_router_requests_total{status=~"5.."}[5m]))'], [])
    result = _run([promtool, "test", "rules", test.name], cwd=tmp_path)
    assert result.returncode != 0


# ---- dashboards


def test_dashboards_exist():
    assert {p.stem for p in DASHBOARDS} >= {"overview", "pd", "replica"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path):
    d = json.loads(path.read_text())
    assert d["uid"].startswith("pdserve-") and len(d["uid"]) <= 40 and d["title"].startswith("pdserve")
    assert d.get("id") is None  # Grafana assigns ids; a fixed one clashes between instances
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in _panels(d)]
    assert len(ids) == len(set(ids))
    targets = 0
    for panel in _panels(d):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            targets += 1
            assert target["datasource"] == panel["datasource"], panel["title"]
            expr = target["expr"]
            assert "pdserve_" in expr, (panel["title"], expr)
            leftover = re.findall(r"\$\{?\w+", _substitute(expr))
            assert not leftover, (panel["title"], leftover)
    assert targets


def test_dashboard_uids_are_unique():
    uids = [d["uid"] for d in _dashboards().values()]
    assert len(uids) == len(set(uids)), uids


def test_replica_dashboard_selects_by_replica():
    d = _dashboards()["replica"]
    variable = {v["name"]: v for v in d["templating"]["list"]}["replica"]
    assert variable["datasource"]["uid"] == "${datasource}" and variable["includeAll"]
    for panel in _panels(d):
        for target in panel.get("targets", []):
            assert 'replica=~"$replica"' in target["expr"], panel["title"]


def test_every_dashboard_expr_parses(promtool, tmp_path):
    """Each expr as a recording rule: `promtool check rules` parses it (and names the one that fails)."""
    exprs = _dashboard_exprs()
    rules = [{"record": f"pdserve_dashboard:check{i}", "expr": _substitute(e)} for i, (_, _, e) in enumerate(exprs)]
    path = tmp_path / "dashboards.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = _run([promtool, "check", "rules", str(path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout


def test_a_broken_dashboard_expr_fails_the_parse(promtool, tmp_path):
    path = tmp_path / "broken.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"record": "pdserve_dashboard:broken", "expr": "sum by (le (rate(pdserve_x_bucket[5m]))"}]}]}))
    assert _run([promtool, "check", "rules", str(path)]).returncode != 0


def test_on_a_healthy_system_every_dashboard_expr_returns_a_series(promtool, tmp_path):
    exprs = sorted({_substitute(e, replica=r) for _, _, e in _dashboard_exprs() for r in (".*", *REPLICAS)})
    test = _healthy_test(tmp_path, exprs, [])
    result = _run([promtool, "test", "rules", test.name], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the chart


ON = ["prometheusRule.enabled=true", "grafana.dashboards.enabled=true"]


def _kinds(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def _dashboard_maps(objects):
    return [o for o in _kinds(objects, "ConfigMap") if o["metadata"]["name"].startswith("pdserve-dashboard-")]


def test_defaults_render_neither(render):
    objects = render()
    assert not _kinds(objects, "PrometheusRule") and not _dashboard_maps(objects)


def test_prometheus_rule_renders_the_rule_file(render):
    (rule,) = _kinds(render(sets=ON), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "pdserve"
    assert rule["spec"]["groups"] == _rule_file()["groups"]


def test_prometheus_rule_options(render):
    (rule,) = _kinds(render(sets=[*ON, "prometheusRule.labels.release=kps", "prometheusRule.namespace=monitoring",
                                  "prometheusRule.ruleLabels.team=ml", "prometheusRule.ruleLabels.severity=none",
                                  "prometheusRule.runbookBaseUrl=https://docs.example.com/alerts/"]),
                     "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["metadata"]["namespace"] == "monitoring"
    rendered = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    for alert in _alerts():
        r = rendered[alert["alert"]]
        assert r["labels"] == {**alert["labels"], "team": "ml"}  # the alert's own severity wins
        assert r["annotations"]["runbook_url"] == f"https://docs.example.com/alerts/#{alert['alert'].lower()}"
        assert r["expr"] == alert["expr"] and r["annotations"]["description"] == alert["annotations"]["description"]


def test_dashboard_config_maps(render):
    maps = _dashboard_maps(render(sets=ON))
    assert len(maps) == len(DASHBOARDS)
    for cm in maps:
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "pdserve" and "annotations" not in cm["metadata"]
        ((key, text),) = cm["data"].items()
        assert key.endswith(".json")
        stem = cm["metadata"]["name"].removeprefix("pdserve-dashboard-")
        assert json.loads(text) == json.loads((CHART / "dashboards" / f"{stem}.json").read_text())


def test_dashboard_config_map_options(render):
    maps = _dashboard_maps(render(sets=[*ON, "grafana.dashboards.label=dash", "grafana.dashboards.labelValue=yes",
                                        "grafana.dashboards.namespace=grafana",
                                        "grafana.dashboards.annotations.grafana_folder=pdserve",
                                        "grafana.dashboards.labels.team=ml"]))
    assert maps
    for cm in maps:
        meta = cm["metadata"]
        assert meta["labels"]["dash"] == "yes" and meta["labels"]["team"] == "ml"
        assert "grafana_dashboard" not in meta["labels"]
        assert meta["namespace"] == "grafana" and meta["annotations"] == {"grafana_folder": "pdserve"}


def test_lint_strict_with_monitoring_on(helm):
    cmd = [helm, "lint", "--strict", str(CHART)] + [a for s in ON for a in ("--set", s)]
    result = _run(cmd)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "prometheusRule.enabledd=true"], "enabledd"),
    (["--set-string", "prometheusRule.enabled=yes"], "/prometheusRule/enabled"),
    (["--set", "prometheusRule.runbookBaseUrl=docs/alerts.md"], "runbookBaseUrl"),
    (["--set", "prometheusRule.labels.release=1"], "release"),
    (["--set", "prometheusRule.namespace=Monitoring"], "namespace"),
    (["--set", "grafana.dashboards.labelValue=1"], "labelValue"),
    (["--set", "grafana.dashboards.label="], "label"),
    (["--set", "grafana.dashboards.folder=pdserve"], "folder"),
    (["--set", "grafana.datasources.enabled=true"], "datasources"),
])
def test_schema_refuses_bad_monitoring_values(helm, args, message):
    result = _run([helm, "template", "pdserve", str(CHART), *args])
    assert result.returncode != 0, f"{args} rendered"
    assert message in result.stderr, result.stderr


def test_packaged_chart_carries_dashboards_and_rules(helm, tmp_path):
    result = _run([helm, "package", str(CHART), "-d", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    (package,) = tmp_path.glob("pdserve-*.tgz")
    with tarfile.open(package) as tar:
        names = set(tar.getnames())
    expected = {f"pdserve/dashboards/{p.name}" for p in DASHBOARDS} | {f"pdserve/rules/{RULES.name}"}
    assert expected <= names, expected - names
