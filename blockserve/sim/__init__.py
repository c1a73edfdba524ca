"""Simulation tools that drive the real scheduler and KV manager without a model."""

from blockserve.sim.shadow_runner import ShadowRunner, ShadowViolation, shadow_continuation

__all__ = ["ShadowRunner", "ShadowViolation", "shadow_continuation"]
