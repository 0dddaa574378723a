"""Planning: a pure function from (facts, desired state) to an ordered, explained list of steps."""
from driverd.plan.model import Desired, FlavorDecision, Plan, Step
from driverd.plan.planner import plan

__all__ = ["Desired", "FlavorDecision", "Plan", "Step", "plan"]
