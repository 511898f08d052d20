"""helm lint --strict, helm template for every example, and validation of every rendered object:
core kinds (kubernetes-validate), the RayService (KubeRay's CRD schema and the operator-only rules),
serveConfigV2 (Ray Serve's ServeDeploySchema and pdserve's SystemConfig), golden manifests."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "deploy" / "helm" / "pdserve"
_spec = importlib.util.spec_from_file_location("pdserve_helm_render_examples_t", CHART.parent / "render_examples.py")
render_examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_examples)

K8S_VERSION = "1.35.0"  # helm 4.1.4 ships with kubectl 1.35
EXAMPLES = render_examples.examples()
BROKEN = sorted((HERE / "broken").glob("*.yaml"))
# what the chart's refusal must mention, per broken values file
BROKEN_MESSAGES = {
    "name-too-long": "at most 47",
    "name-not-dns1035": "DNS-1035",
    "duplicate-group-name": "used twice",
    "replicas-above-max": "minReplicas <= replicas <= maxReplicas",
    "replicas-below-min": "minReplicas <= replicas <= maxReplicas",
    "num-cpus-with-resources": "rayStartParams.num-cpus cannot be set together",
    "resources-param-with-resources": "rayStartParams.resources cannot be set together",
    "labels-in-ray-start-params": "rayStartParams.labels is not allowed",
}
CUSTOM_KINDS = {("ray.io/v1", "RayService"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                ("monitoring.coreos.com/v1", "PodMonitor")}


def _rayservice(objects):
    (rs,) = [o for o in objects if o["kind"] == "RayService"]
    return rs


def test_broken_files_are_all_listed():
    assert sorted(p.stem for p in BROKEN) == sorted(BROKEN_MESSAGES)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_lint_strict(helm, name):
    cmd = [helm, "lint", "--strict", str(CHART)] + [a for p in EXAMPLES[name] for a in ("-f", str(p))]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_rendered_objects_validate(render, rayservice_schema, operator_rules, name):
    objects = render(EXAMPLES[name])
    kinds = {o["kind"] for o in objects}
    assert {"RayService", "Service", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    rs = _rayservice(objects)
    rayservice_schema.validate(rs)
    assert operator_rules(rs) == []
    for template in _pod_templates(rs):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, K8S_VERSION, strict=True)


def _pod_templates(rs):
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_serve_config_validates(render, name):
    from ray.serve.schema import ServeDeploySchema

    from pdserve.services.app import SystemConfig
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.serve_builder import system_config

    rs = _rayservice(render(EXAMPLES[name]))
    serve_config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    schema = ServeDeploySchema.model_validate(serve_config)
    apps = {app.name: app for app in schema.applications}
    assert apps["pdserve"].import_path == "pdserve.services.serve_builder:build_pdserve"
    for app in apps.values():
        config = system_config(app.args, {"PDSERVE_REDIS_PASSWORD": "p@ss/word"})
        assert "${" not in (config.redis_url or "")
        roles = ["decode"] + (["prefill"] if config.mode == "disaggregated" else [])
        for role in roles:
            config.worker(role)  # WorkerConfig validation
        RouterConfig.model_validate(config.router)
        if app.name == "kvstore":
            assert app.import_path.endswith(":build_kvstore") and config.kvstore_config() is not None
    assert SystemConfig.model_validate(apps["pdserve"].args) == SystemConfig.model_validate(
        serve_config["applications"][-1]["args"])


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_replicas_are_pinned_to_their_group(render, name):
    """Each role's Serve replicas select the Ray label its worker group (and only it) carries."""
    rs = _rayservice(render(EXAMPLES[name]))
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][-1]
    overrides = {d["name"]: d for d in app.get("deployments", [])}
    roles = [r for r in ("prefill", "decode") if r in app["args"] and (r == "decode" or app["args"]["mode"] == "disaggregated")]
    for role in roles:
        selector = app["args"][role]["label_selector"]
        if "ray_actor_options" in overrides.get(role, {}):
            assert overrides[role]["ray_actor_options"]["label_selector"] == selector
        matching = [n for n, g in groups.items() if selector.items() <= g.get("labels", {}).items()]
        assert matching == [role], (role, selector, matching)


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_pod_has_the_serve_settings_pdserve_serve_uses(render, name):
    """The Ray/Serve latency settings are in every pod's env (Ray reads them where it starts), and the
    chart's defaults are `pdserve serve`'s (BASE_ENV), so the two cannot drift apart."""
    from pdserve.runtime.serve_env import BASE_ENV

    assert yaml.safe_load((CHART / "values.yaml").read_text())["serve"]["env"] == BASE_ENV
    for template in _pod_templates(_rayservice(render(EXAMPLES[name]))):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert BASE_ENV.items() <= env.items(), env


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_pod_keeps_the_malloc_arenas_pdserve_serve_keeps(render, name):
    from pdserve.runtime.serve_env import MALLOC_ARENA_MAX

    assert str(yaml.safe_load((CHART / "values.yaml").read_text())["serve"]["mallocArenaMax"]) == MALLOC_ARENA_MAX
    for template in _pod_templates(_rayservice(render(EXAMPLES[name]))):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
        assert env["MALLOC_ARENA_MAX"] == MALLOC_ARENA_MAX, env


def test_malloc_arenas_zero_leaves_glibcs_default_and_a_negative_count_is_refused(helm):
    text = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "serve.mallocArenaMax=0"],
                          capture_output=True, text=True, check=True).stdout
    for template in _pod_templates(_rayservice([d for d in yaml.safe_load_all(text) if d])):
        assert "MALLOC_ARENA_MAX" not in {e["name"] for e in template["spec"]["containers"][0]["env"]}
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "serve.mallocArenaMax=-1"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "mallocArenaMax" in result.stderr, result.stderr


def test_serve_settings_can_be_overridden_and_only_ray_names_are_taken(helm):
    text = subprocess.run([helm, "template", "pdserve", str(CHART), "--set-string",
                           "serve.env.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1"],
                          capture_output=True, text=True, check=True).stdout
    head = _pod_templates(_rayservice([d for d in yaml.safe_load_all(text) if d]))[0]
    env = {e["name"]: e.get("value") for e in head["spec"]["containers"][0]["env"]}
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1" and env["RAY_worker_niceness"] == "0"
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "serve.env.PATH=/tmp"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "'PATH' does not match pattern '^RAY_" in result.stderr, result.stderr


@pytest.mark.parametrize("broken", BROKEN, ids=lambda p: p.stem)
def test_broken_values_fail(helm, broken):
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "-f", str(broken)], capture_output=True, text=True)
    assert result.returncode != 0, f"{broken.name} rendered"
    assert BROKEN_MESSAGES[broken.stem] in result.stderr, result.stderr


def _break(rs, rule):
    rs = copy.deepcopy(rs)
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    if rule == "name-too-long":
        rs["metadata"]["name"] = "p" * 48
    elif rule == "name-not-dns1035":
        rs["metadata"]["name"] = "Pdserve_1"
    elif rule == "duplicate-group-name":
        groups[1]["groupName"] = groups[0]["groupName"]
    elif rule == "replicas-above-max":
        groups[0]["replicas"] = groups[0]["maxReplicas"] + 1
    elif rule == "replicas-below-min":
        groups[0]["minReplicas"] = groups[0]["replicas"] + 1
    elif rule == "num-cpus-with-resources":
        groups[0]["resources"], groups[0]["rayStartParams"] = {"CPU": "2"}, {"num-cpus": "2"}
    elif rule == "resources-param-with-resources":
        groups[0]["resources"], groups[0]["rayStartParams"] = {"x": "1"}, {"resources": '{"x": 1}'}
    elif rule == "labels-in-ray-start-params":
        groups[0]["rayStartParams"] = {"labels": "a=b"}
    return rs


@pytest.mark.parametrize("rule", sorted(BROKEN_MESSAGES))
def test_operator_rule_checker_catches_each_rule(render, operator_rules, rayservice_schema, rule):
    """The check applied to every rendered RayService above fails on an object breaking one rule,
    which the CRD schema alone accepts."""
    broken = _break(_rayservice(render()), rule)
    rayservice_schema.validate(broken)
    assert len(operator_rules(broken)) == 1


def test_schema_rejects_unknown_values(helm):
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "prefill.replicaz=2"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "replicaz" in result.stderr


def test_golden_manifests_are_fresh(helm, monkeypatch, capsys):
    monkeypatch.setenv("HELM", helm)
    assert render_examples.main(["--check"]) == 0, capsys.readouterr().out


def test_golden_check_detects_staleness(helm, monkeypatch, tmp_path):
    """A chart change that the goldens do not reflect is reported."""
    monkeypatch.setenv("HELM", helm)
    examples = CHART / "examples"
    original = (examples / "default.yaml").read_text()
    try:
        (examples / "default.yaml").write_text(original.replace("replicas: 1", "replicas: 7", 1))
        assert render_examples.main(["--check"]) == 1
    finally:
        (examples / "default.yaml").write_text(original)


def test_crd_schema_rejects_a_wrong_type(render, rayservice_schema):
    import jsonschema

    rs = _rayservice(render())
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        rayservice_schema.validate(rs)


def test_quantization_per_role_renders_into_the_serve_config(render, helm):
    """`prefill.worker.quantization` / `decode.worker.quantization` reach each role's WorkerConfig and its
    engine; a value the engine does not know is refused by the chart's schema."""
    from pdserve.services.serve_builder import system_config

    rs = _rayservice(render(sets=["prefill.worker.quantization=int8", "decode.worker.quantization=auto",
                                  "decode.worker.dtype=auto"]))
    args = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][-1]["args"]
    config = system_config(args, {"PDSERVE_REDIS_PASSWORD": "x"})
    assert config.worker("prefill").engine_config().quantization == "int8"
    decode = config.worker("decode").engine_config()
    assert (decode.quantization, decode.dtype) == ("auto", "auto")
    default = yaml.safe_load(_rayservice(render())["spec"]["serveConfigV2"])["applications"][-1]["args"]
    assert "quantization" not in default["decode"]  # WorkerConfig's default (auto) applies
    assert system_config(default, {"PDSERVE_REDIS_PASSWORD": "x"}).worker("decode").quantization == "auto"
    result = subprocess.run([helm, "template", "pdserve", str(CHART), "--set", "decode.worker.quantization=int3"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "quantization" in result.stderr, result.stderr
