"""What a step is: an idempotent action that can check, act and name its undo.

The executor only knows this interface; the implementations live in driverd.apply.steps and are
handed to it as an explicit registry (action name -> implementation).
"""
from __future__ import annotations

from dataclasses import field
from typing import Any, Callable

from driverd.datatypes import dataclass
from driverd.plan.actions import ACTIONS, MODULES, PACKAGE, USERSPACE  # noqa: F401  (the steps' vocabulary)


@dataclass
class StepContext:
    """What the steps of one transaction work with: the host root, runner, configuration and the run's document."""
    root: Any
    runner: Any
    kernel: Any
    config: Any
    services: Any
    doc: dict = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: None
    # what the steps read of the host that a transaction does not change (the PCI devices), read once per
    # transaction: lifecycle.transact empties it
    memo: dict = field(default_factory=dict)

    def warn(self, msg: str) -> None:
        self.doc.setdefault("warnings", []).append(msg)
        self.log(f"warning: {msg}")


class StepImpl:
    """One idempotent action. Subclasses set `action` and override what applies; what the action
    may change (`touches`) and whether it only records or verifies (`read_only`) is the planner's
    table, driverd.plan.actions, so the step lists and the executor agree."""
    action = ""

    @property
    def touches(self) -> frozenset[str]:
        return ACTIONS[self.action].touches

    @property
    def read_only(self) -> bool:
        return ACTIONS[self.action].read_only

    def check(self, ctx: StepContext, params: dict) -> bool:
        """True when the step's effect is already in place (the step is then skipped)."""
        return False

    def do(self, ctx: StepContext, params: dict) -> dict | None:
        raise NotImplementedError

    def preflight(self, ctx: StepContext, params: dict) -> None:
        """Read-only checks that refuse the whole request before it starts (no journal, nothing
        changed): e.g. a package built for another kernel. Raise a DriverdError to refuse."""

    def preimage(self, ctx: StepContext, params: dict) -> list[str]:
        """Host files whose bytes the executor keeps in the journal before do() runs, so that a
        failure half-way through do() can still be undone byte for byte."""
        return []

    def undo(self, ctx: StepContext, params: dict, entry: dict) -> list[dict]:
        """Steps that revert this one (journaled like any other). `entry` is the step's journal
        record: its status, result (absent when do() raised) and preimage ("before").
        Package and module steps return nothing: the last-known-good convergence covers them."""
        return []

    def describe(self, params: dict) -> str:
        return self.action


Registry = dict[str, StepImpl]
