"""Decode worker: imports KV from prefill workers (or prefills locally) and streams tokens."""
