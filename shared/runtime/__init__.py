"""Processes and environment the deployments run beside: a local Redis (and its health), Ray Serve's
environment."""
