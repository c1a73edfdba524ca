"""Simulation tools that drive the real scheduler and KV manager without a model."""

from blockserve.sim.shadow_runner import ShadowRunner, ShadowViolation

__all__ = ["ShadowRunner", "ShadowViolation"]
