"""Memory planning: the train step compiled ahead of time for a device topology, per-device bytes by category,
the technique ladder and the max-context search (`jaxlong.plan.planner`); the CLI is `python -m jaxlong.memory`."""

from jaxlong.plan.planner import LADDER, apply_rung, ladder, max_context, plan

__all__ = ["LADDER", "apply_rung", "ladder", "max_context", "plan"]
