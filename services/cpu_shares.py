"""How many Ray CPUs the router, prefill and decode replicas ask for, fitted to the CPUs Ray sees.

A share a config states (`router.num_cpus`, `prefill.num_cpus`, `decode.num_cpus`) is kept as given;
the roles that state none divide what is left. A worker's share is per rank: a tensor-parallel replica of
n ranks (n processes) asks for n shares. Invariant: the shares of every replica placed by `pdserve serve`
sum to at most the CPUs Ray sees, so no replica waits forever to be scheduled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pdserve.services.app import SystemConfig

ROUTER_SHARE = 0.5  # what the router asks for when there is room: it runs no model
MIN_ROUTER_SHARE = 0.1
MIN_WORKER_SHARE = 0.25  # below this a model replica would be starved on any machine
MAX_WORKER_SHARE = 8.0  # torch threads beyond this buy little for one rank


class Unschedulable(ValueError):
    """The config asks for more than the cluster has; the message says what to change."""


@dataclass(frozen=True)
class CPUShares:
    total: float
    router: float
    prefill: float | None  # None: colocated, no prefill pool; per rank, as decode
    decode: float
    num_router: int
    num_prefill: int
    num_decode: int
    prefill_ranks: int = 1  # tensor_parallel_size: processes per replica
    decode_ranks: int = 1

    @property
    def used(self) -> float:
        return (self.router * self.num_router + (self.prefill or 0.0) * self.num_prefill * self.prefill_ranks
                + self.decode * self.num_decode * self.decode_ranks)

    def describe(self) -> str:
        def ranks(n: int) -> str:
            return f"{n} ranks x " if n > 1 else ""

        parts = [f"router {self.num_router} x {self.router:g}"]
        if self.prefill is not None:
            parts.append(f"prefill {self.num_prefill} x {ranks(self.prefill_ranks)}{self.prefill:g}")
        parts.append(f"decode {self.num_decode} x {ranks(self.decode_ranks)}{self.decode:g}")
        return f"CPU split of the {self.total:g} CPUs Ray sees: " + ", ".join(parts) + f" ({self.used:g} used)"

    def apply(self, config: SystemConfig) -> SystemConfig:
        update: dict[str, Any] = {
            "router": {**config.router, "num_cpus": self.router},
            "decode": {**config.decode, "num_cpus": self.decode},
        }
        if self.prefill is not None:
            update["prefill"] = {**config.prefill, "num_cpus": self.prefill}
        return config.model_copy(update=update)


def _floor(value: float, step: float = 0.05) -> float:
    return math.floor(value / step + 1e-9) * step


def fit_cpu_shares(config: SystemConfig, total_cpus: float) -> CPUShares:
    """The split for `config` on `total_cpus`; raises Unschedulable when no split fits."""
    disaggregated = config.mode == "disaggregated"
    num_router = int(config.router.get("num_replicas", 1))
    num_prefill = int(config.prefill.get("num_replicas", 1)) if disaggregated else 0
    num_decode = int(config.decode.get("num_replicas", 1))
    prefill_ranks = int(config.prefill.get("tensor_parallel_size", 1)) if disaggregated else 1
    decode_ranks = int(config.decode.get("tensor_parallel_size", 1))
    router = config.router.get("num_cpus")
    prefill = config.prefill.get("num_cpus") if disaggregated else None
    decode = config.decode.get("num_cpus")
    if router is None:
        router = ROUTER_SHARE if total_cpus >= 4 else max(MIN_ROUTER_SHARE, _floor(total_cpus / 8))
    fixed = (router * num_router + (prefill or 0.0) * num_prefill * prefill_ranks
             + (decode or 0.0) * num_decode * decode_ranks)
    open_ranks = ((num_prefill * prefill_ranks if disaggregated and prefill is None else 0)
                  + (num_decode * decode_ranks if decode is None else 0))
    if open_ranks:
        share = min(MAX_WORKER_SHARE, _floor((total_cpus - fixed) / open_ranks))
        if share < MIN_WORKER_SHARE:
            raise Unschedulable(_advice(total_cpus, fixed, open_ranks, num_router, num_prefill, num_decode))
        if disaggregated and prefill is None:
            prefill = share
        if decode is None:
            decode = share
    shares = CPUShares(float(total_cpus), float(router), None if prefill is None else float(prefill),
                       float(decode), num_router, num_prefill, num_decode, prefill_ranks, decode_ranks)
    if shares.used > total_cpus + 1e-9:
        raise Unschedulable(
            f"the configured CPU shares need {shares.used:g} CPUs but Ray sees {total_cpus:g}: lower "
            "router/prefill/decode num_cpus or num_replicas in the config, or run on a machine with more "
            "CPUs (--num-cpus N tells Ray how many to use)")
    return shares


def check_labels(config: SystemConfig, node_labels: list[dict[str, str]]) -> None:
    """Raises Unschedulable when a role's label_selector matches no node (its replicas would wait forever).

    Only equality selectors are checked here; Ray's `!`/`in()` forms are left to Ray.
    """
    roles = [("decode", config.decode)] + ([("prefill", config.prefill)] if config.mode == "disaggregated" else [])
    for role, overrides in roles:
        selector = {k: v for k, v in (overrides.get("label_selector") or {}).items()
                    if not v.startswith(("!", "in(", "!in("))}
        if selector and not any(all(labels.get(k) == v for k, v in selector.items()) for labels in node_labels):
            raise Unschedulable(
                f"no node has the labels {role}.label_selector asks for ({selector}); start the local "
                f"node with them (ray start --labels ...) or drop {role}.label_selector from the config")


def _advice(total: float, fixed: float, open_ranks: int, num_router: int, num_prefill: int, num_decode: int) -> str:
    need = fixed + open_ranks * MIN_WORKER_SHARE
    return (
        f"{num_router} router, {num_prefill} prefill and {num_decode} decode replicas need at least "
        f"{need:g} CPUs ({MIN_WORKER_SHARE:g} per model replica rank) but Ray sees {total:g}: use fewer replicas "
        "(--prefill-replicas / --decode-replicas) or ranks (--tensor-parallel-size), --mode colocated, or a "
        "machine with more CPUs")
