"""Placement: where a request runs, as pure functions over replica stats snapshots (no Ray, no torch).

The router deployment feeds them live stats (services/router/placer.py); the placement simulator
(pdserve.bench.placement) feeds them simulated replicas. `policy` holds the contract (PlacementPolicy, the
snapshot and request types) and the simple policies; slo_aware and kv_aware the model-driven ones."""
