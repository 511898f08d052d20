"""What a link call raises on the router side, by the status the worker gave (or the connection's loss)."""

from __future__ import annotations


class WorkerLinkError(Exception):
    """The worker failed the call (its details are in the worker's log, not here)."""


class WorkerUnavailable(WorkerLinkError):
    """The replica is gone or unreachable: nothing it started survives, so the caller may go elsewhere."""


class WorkerOverloaded(WorkerLinkError):
    """The replica refused the call: it has as many in flight as it takes."""
