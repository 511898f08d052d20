"""Ray Serve deployments of pdserve (router, prefill, decode, kvstore)."""
