"""The worker link: the router's direct connection to each prefill and decode replica.

Ray Serve runs the replicas (placement, health, restarts, scaling); the per-request calls between the
router and the replica placement chose go over this link instead of a Serve handle: one call per
prefill and one stream per decode, as length-prefixed frames over pooled TCP connections
(pdserve.worklink.frames), encoded with msgpack (never pickle). A replica publishes its link's address
and token in its routing stats; until the router has seen them, calls go through Serve's handles.
"""

from pdserve.worklink.client import Link, LinkClient, LinkStream
from pdserve.worklink.codec import CodecError
from pdserve.worklink.errors import WorkerLinkError, WorkerOverloaded, WorkerUnavailable
from pdserve.worklink.server import LinkServer

__all__ = ["CodecError", "Link", "LinkClient", "LinkServer", "LinkStream", "WorkerLinkError", "WorkerOverloaded",
           "WorkerUnavailable"]
