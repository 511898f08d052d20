"""Prefill worker: runs prompts in prefill-only mode and exports their KV."""
