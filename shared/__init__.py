"""pdserve: disaggregated prefill/decode LLM serving.

The library (this package) holds the engine, the model family and the shared
wire types; `pdserve.services` holds the Ray Serve deployments.
"""

__version__ = "0.1.0"
