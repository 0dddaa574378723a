"""Planning: a pure function from (facts, desired state) to an ordered, explained list of steps.

The names are loaded on first use (PEP 562): `driverd detect` reads one small module of this package
(plan/companions.py, who owns the fabric's daemons) and should not pay for the planner's imports."""
from __future__ import annotations

__all__ = ["Desired", "FlavorDecision", "Plan", "Step", "plan"]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.plan.model import Desired, FlavorDecision, Plan, Step
    from driverd.plan.planner import plan


def __getattr__(name: str):
    if name == "plan":
        from driverd.plan.planner import plan
        return plan
    if name in ("Desired", "FlavorDecision", "Plan", "Step"):
        from driverd.plan import model
        return getattr(model, name)
    raise AttributeError(f"module 'driverd.plan' has no attribute {name!r}")
