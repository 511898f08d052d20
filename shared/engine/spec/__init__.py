"""Speculative decoding: draft proposers (ABC + registry), draft capping, and verification."""

from pdserve.engine.spec.drafter import Drafter
from pdserve.engine.spec.proposer import PROPOSERS, Proposer, create_proposer

__all__ = ["Drafter", "PROPOSERS", "Proposer", "create_proposer"]
