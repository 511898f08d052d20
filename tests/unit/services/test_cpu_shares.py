"""CPU shares fitted to the CPUs Ray sees: table by table, including the 2-core machine `make serve` runs on."""

from __future__ import annotations

import pytest

from pdserve.services.app import SystemConfig
from pdserve.services.cpu_shares import MIN_WORKER_SHARE, Unschedulable, fit_cpu_shares


@pytest.mark.parametrize(
    ("cpus", "mode", "router", "prefill", "decode"),
    [
        (2, "disaggregated", 0.25, 0.85, 0.85),  # this project's machine: everything fits in 2 CPUs
        (2, "colocated", 0.25, None, 1.75),
        (3, "disaggregated", 0.35, 1.3, 1.3),
        (4, "disaggregated", 0.5, 1.75, 1.75),
        (16, "disaggregated", 0.5, 7.75, 7.75),
        (64, "disaggregated", 0.5, 8.0, 8.0),  # capped: more torch threads buy little for one replica
    ],
)
def test_default_split(cpus, mode, router, prefill, decode):
    shares = fit_cpu_shares(SystemConfig(mode=mode), cpus)
    assert shares.router == pytest.approx(router) and shares.decode == pytest.approx(decode)
    assert shares.prefill == (None if prefill is None else pytest.approx(prefill))
    assert shares.used <= cpus


def test_split_is_applied_to_every_role():
    config = fit_cpu_shares(SystemConfig(), 2).apply(SystemConfig())
    assert config.router["num_cpus"] == pytest.approx(0.25)
    assert config.worker("prefill").num_cpus == pytest.approx(0.85)
    assert config.worker("decode").num_cpus == pytest.approx(0.85)
    assert config.worker("decode").engine_config().num_threads == 1


def test_stated_shares_are_kept_and_the_rest_divides_what_is_left():
    config = SystemConfig(prefill={"num_cpus": 3, "num_replicas": 1}, decode={"num_replicas": 2})
    shares = fit_cpu_shares(config, 8)
    assert shares.prefill == 3 and shares.router == 0.5
    assert shares.decode == pytest.approx(2.25)  # (8 - 3 - 0.5) / 2
    assert shares.used <= 8


def test_too_many_replicas_fail_with_advice():
    config = SystemConfig(prefill={"num_replicas": 4}, decode={"num_replicas": 4})
    with pytest.raises(Unschedulable, match="--prefill-replicas / --decode-replicas"):
        fit_cpu_shares(config, 2)
    shares = fit_cpu_shares(config, 8)
    assert shares.prefill >= MIN_WORKER_SHARE and shares.used <= 8


def test_stated_shares_beyond_the_machine_fail_with_advice():
    with pytest.raises(Unschedulable, match="need 3.25 CPUs but Ray sees 2"):
        fit_cpu_shares(SystemConfig(prefill={"num_cpus": 1}, decode={"num_cpus": 2}), 2)


def test_describe_states_the_split():
    text = fit_cpu_shares(SystemConfig(), 2).describe()
    assert text == "CPU split of the 2 CPUs Ray sees: router 1 x 0.25, prefill 1 x 0.85, decode 1 x 0.85 (1.95 used)"


def test_a_label_selector_no_node_has_fails_with_advice():
    from pdserve.services.cpu_shares import check_labels

    config = SystemConfig(prefill={"label_selector": {"pool": "compute"}}, decode={"label_selector": {"pool": "hbm"}})
    nodes = [{"ray.io/node-id": "a", "pool": "compute"}, {"ray.io/node-id": "b", "pool": "hbm"}]
    check_labels(config, nodes)
    with pytest.raises(Unschedulable, match="decode.label_selector"):
        check_labels(config, nodes[:1])
    with pytest.raises(Unschedulable, match="prefill.label_selector"):
        check_labels(config, nodes[1:])
    check_labels(SystemConfig(mode="colocated", prefill={"label_selector": {"pool": "gone"}}), nodes[1:])
