"""A discrete-event model of a pdserve system: arrivals (synthetic or trace), routers placing with the live
placement code on polled stats, prefill replicas with chunked prefill, the KV handoff, decode replicas with
continuous batching and preemption, the colocated shape, and SLO-driven autoscaling. Timed by the same
latency profiles as the live system (pdserve.latency_model). See docs/simulator.md."""

from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec, SimRequest
from pdserve.sim.engine import Engine
from pdserve.sim.results import RequestRecord

__all__ = ["ClusterSpec", "Engine", "EngineSpec", "RequestRecord", "RouterSpec", "SimRequest", "Simulation"]
