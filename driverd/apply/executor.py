"""The executor: runs a list of steps through the step registry with the journal.

For every step: journal says `running` (fsync) -> check() (already done? then skip) -> do() ->
journal says `done` (fsync). A step that fails turns the run into `rolling-back`: the rollback list
(each done step's own undo steps in reverse, then - when the driver was touched - the convergence
back to the last-known-good driver) is written into the journal and executed the same way. A run
found `running` or `rolling-back` on start is continued where it stopped; steps are idempotent, so
re-running the one that was interrupted is safe.

Test hook: DRIVERD_TEST_CRASH_AT=N makes the process SIGKILL itself at the Nth step boundary (a
boundary is just before and just after each step's action); DRIVERD_TEST_BOUNDARIES=FILE appends
each boundary's label to FILE. Used by the crash-safety tests, inert otherwise.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from driverd.apply.journal import UNFINISHED, Journal
from driverd.errors import DriverdError, JournalError

DRIVER_ACTIONS = {"install-package", "unload-modules", "load-modules", "stop-gpu-daemons", "start-gpu-daemons",
                  "start-persistenced", "start-fabricmanager", "restore-package", "restore-previous-package"}


@dataclass
class StepContext:
    root: Any
    runner: Any
    kernel: Any
    config: Any
    services: Any
    doc: dict = field(default_factory=dict)
    log: Callable[[str], None] = lambda msg: None

    def warn(self, msg: str) -> None:
        self.doc.setdefault("warnings", []).append(msg)
        self.log(f"warning: {msg}")


class StepImpl:
    """One idempotent action. Subclasses set `action` and override what applies."""
    action = ""
    touches_driver = False

    def check(self, ctx: StepContext, params: dict) -> bool:
        """True when the step's effect is already in place (the step is then skipped)."""
        return False

    def do(self, ctx: StepContext, params: dict) -> dict | None:
        raise NotImplementedError

    def undo(self, ctx: StepContext, params: dict, result: dict | None) -> list[dict]:
        """Steps that revert this one (journaled like any other). Driver steps return nothing:
        the last-known-good convergence covers them."""
        return []

    def describe(self, params: dict) -> str:
        return self.action


REGISTRY: dict[str, StepImpl] = {}


def register(cls):
    REGISTRY[cls.action] = cls()
    return cls


class _Boundaries:
    def __init__(self) -> None:
        self.count = 0
        at = os.environ.get("DRIVERD_TEST_CRASH_AT")
        self.crash_at = int(at) if at and at.isdigit() else None
        self.trace = os.environ.get("DRIVERD_TEST_BOUNDARIES")

    def hit(self, label: str) -> None:
        self.count += 1
        if self.trace:
            with open(self.trace, "a") as f:
                f.write(f"{self.count} {label}\n")
        if self.crash_at == self.count:
            os.kill(os.getpid(), signal.SIGKILL)


class Executor:
    def __init__(self, ctx: StepContext, journal: Journal, registry: dict[str, StepImpl] | None = None) -> None:
        self.ctx = ctx
        self.journal = journal
        self.registry = registry if registry is not None else REGISTRY
        self.bounds = _Boundaries()

    def pending(self) -> dict | None:
        doc = self.journal.load()
        return doc if doc and doc.get("state") in UNFINISHED else None

    def run(self, command: str, steps: list[dict], meta: dict | None = None) -> dict:
        """Start a run (archiving a finished journal), or continue an unfinished one first."""
        doc = self.pending()
        if doc is not None:
            doc["resumed"] = doc.get("resumed", 0) + 1
            self.ctx.log(f"resuming interrupted run {doc['run_id']} ({doc['command']}, {doc['state']})")
            return self._continue(doc)
        for s in steps:
            if s["action"] not in self.registry:
                raise JournalError(f"no implementation for step {s['action']}", fix="this is a driverd bug")
        old = self.journal.load()
        if old is not None:
            self.journal.archive(old)
        doc = self.journal.new(command, steps, meta)
        self.journal.save(doc)
        return self._continue(doc)

    def preview(self, command: str, steps: list[dict]) -> dict:
        """--dry-run: what a run would do, step by step, without doing it or writing a journal.
        Each step's check() (read-only) tells whether it is already in place."""
        doc = self.pending()
        if doc is not None:
            command = f"{doc['command']} (unfinished run {doc['run_id']}, {doc['state']})"
            steps = [s for s in doc["rollback" if doc["state"] == "rolling-back" else "steps"]
                     if s["status"] not in ("done", "skipped")]
        out = []
        for s in steps:
            impl = self.registry.get(s["action"])
            if impl is None:
                raise JournalError(f"no implementation for step {s['action']}", fix="this is a driverd bug")
            params = s.get("params", {})
            try:
                state = "in place" if impl.check(self.ctx, params) else "would run"
            except DriverdError as e:
                state = f"would run (cannot tell now: {e.message})"
            out.append({"action": s["action"], "description": impl.describe(params), "state": state,
                        "params": params})
            self.ctx.log(f"  {'=' if state == 'in place' else '>'} {impl.describe(params)}: {state}")
        return {"command": command, "dry_run": True, "steps": out}

    def rollback_now(self, reason: str) -> dict:
        """Turn an unfinished forward run into a rollback (driverd rollback while a run is pending)."""
        doc = self.pending()
        if doc is None:
            raise JournalError("no unfinished run to roll back", fix="driverd rollback without a pending run "
                               "returns to the previous installed driver")
        if doc["state"] == "running":
            doc["failure"] = {"step": None, "error": {"error": reason}}
            self._start_rollback(doc)
        return self._continue(doc)

    # -- internals ---------------------------------------------------------------------------
    def _continue(self, doc: dict) -> dict:
        self.ctx.doc = doc
        if doc["state"] == "running":
            for i, s in enumerate(doc["steps"]):
                if s["status"] in ("done", "skipped"):
                    continue
                if not self._step(doc, s, f"{i}:{s['action']}"):
                    self._start_rollback(doc)
                    break
            else:
                doc["state"] = "done"
                doc["finished_at"] = time.time()
                self.journal.save(doc)
                return doc
        if doc["state"] == "rolling-back":
            for i, s in enumerate(doc["rollback"]):
                if s["status"] in ("done", "skipped"):
                    continue
                if not self._step(doc, s, f"rollback-{i}:{s['action']}"):
                    doc["state"] = "rollback-failed"
                    doc["finished_at"] = time.time()
                    self.journal.save(doc)
                    return doc
            doc["state"] = "rolled-back"
            doc["finished_at"] = time.time()
            self.journal.save(doc)
        return doc

    def _step(self, doc: dict, s: dict, label: str) -> bool:
        impl = self.registry[s["action"]]
        s["status"] = "running"
        s["started_at"] = time.time()
        self.journal.save(doc)
        self.bounds.hit(f"before {label}")
        try:
            if impl.check(self.ctx, s["params"]):
                s["status"] = "skipped"
                self.ctx.log(f"  = {impl.describe(s['params'])}: already in place")
            else:
                self.ctx.log(f"  > {impl.describe(s['params'])}")
                s["result"] = impl.do(self.ctx, s["params"]) or {}
                s["status"] = "done"
        except DriverdError as e:
            s["status"] = "failed"
            s["error"] = e.to_json()
            self.ctx.log(f"  ! {impl.describe(s['params'])} failed: {e.one_line()}")
            if doc["state"] == "running":
                doc["failure"] = {"step": s["action"], "error": e.to_json()}
            else:
                doc["rollback_failure"] = {"step": s["action"], "error": e.to_json()}
            self.journal.save(doc)
            return False
        self.bounds.hit(f"after {label}")
        s["finished_at"] = time.time()
        self.journal.save(doc)
        return True

    def _start_rollback(self, doc: dict) -> None:
        rb: list[dict] = []
        touched = False
        for s in reversed(doc["steps"]):
            if s["status"] in ("pending",):
                continue
            impl = self.registry[s["action"]]
            touched = touched or impl.touches_driver
            if s["status"] in ("done", "running", "failed"):
                rb += impl.undo(self.ctx, s["params"], s.get("result"))
        if touched:
            from driverd.apply.steps import restore_lkg_steps
            rb += restore_lkg_steps(doc.get("lkg"), self.ctx)
        doc["rollback"] = [{"action": r["action"], "params": r.get("params", {}), "reason": r.get("reason", ""),
                            "status": "pending"} for r in rb]
        doc["state"] = "rolling-back"
        self.journal.save(doc)
