"""SLO-driven autoscaling per role (prefill, decode), as a pure function: no Ray, no I/O, no torch.
`decide(inputs, profile, config, state)` returns the desired replicas per role and the next state."""

from pdserve.autoscale.config import POLICIES, ROLES, AutoscaleConfig, RoleBounds
from pdserve.autoscale.policy import Decision, RoleDecision, RoleStats, ScalingInputs, Traffic, decide

__all__ = ["POLICIES", "ROLES", "AutoscaleConfig", "Decision", "RoleBounds", "RoleDecision", "RoleStats",
           "ScalingInputs", "Traffic", "decide"]
