"""Benchmark commands (`pdserve bench ...`): each prints one JSON object with ratios against a peer."""
