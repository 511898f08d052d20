"""Handoff params: plain data that tells a decode worker where and how to pull a request's KV.

Like vLLM's `kv_transfer_params`, they travel in the prefill response; tensors never do. The type is
part of the router/worker contract (`pdserve.api.contract`), which the router imports without torch.
"""

from pdserve.api.contract import HandoffParams

__all__ = ["HandoffParams"]
