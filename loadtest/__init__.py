"""Goodput load tests: arrivals, workloads, an async streaming client, SLO metrics, sweeps, plots, scenarios."""
