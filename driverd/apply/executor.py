"""The executor: runs a list of steps through an explicit step registry with the journal.

For every step: journal says `running` (fsync) -> preimage of the files the step may change ->
check() (already in place? then skip) -> do() -> journal says `done` (fsync). *Any* exception from
a step is a failed step: the run turns `rolling-back`, the rollback list (each started step's own
undo steps in reverse, then - for what the run touched of the package and the modules - the
convergence back to the last-known-good state recorded by the snapshot) is written into the
journal and executed the same way. A run found `running` or `rolling-back` is continued where it
stopped; steps are idempotent, so re-running the one that was interrupted is safe.

The caller holds the host lock (driverd.apply.lock) for as long as an Executor changes anything.
"""
from __future__ import annotations

import base64
import time
from typing import Callable

from driverd import log as logs
from driverd.apply.journal import UNFINISHED, Journal
from driverd.apply.step import Registry, StepContext
from driverd.errors import DriverdError, JournalError

# converge(lkg, touched, ctx) -> the steps that bring the touched parts back to the snapshot.
Converge = Callable[[dict | None, set, StepContext], list[dict]]


def error_record(e: BaseException) -> dict:
    """A step's failure as the journal keeps it: a DriverdError's own fields, or for anything else
    the exception's type and text (an OSError, a KeyError from a damaged file...)."""
    if isinstance(e, DriverdError):
        return e.to_json()
    text = f"{e.__class__.__name__}: {e}"
    return {"error": text, "subject": "unexpected", "cause": text,
            "fix": "see the error; driverd rolled back what the run had changed", "exit_code": 1}


class Executor:
    def __init__(self, ctx: StepContext, journal: Journal, registry: Registry, converge: Converge) -> None:
        self.ctx = ctx
        self.journal = journal
        self.registry = registry
        self.converge = converge

    def pending(self, repair: bool = True) -> dict | None:
        doc = self.journal.load(repair=repair)
        return doc if doc and doc.get("state") in UNFINISHED else None

    def _known(self, steps: list[dict]) -> None:
        for s in steps:
            if s["action"] not in self.registry:
                raise JournalError(f"no implementation for step {s['action']}", fix="this is a driverd bug")

    def in_place(self, steps: list[dict]) -> bool:
        """True when every step that is not read-only says its effect is already in place: such a
        run would change nothing, so it is not started and nothing is written."""
        self._known(steps)
        for s in steps:
            impl = self.registry[s["action"]]
            if impl.read_only:
                continue
            try:
                if not impl.check(self.ctx, s.get("params", {})):
                    return False
            except Exception:
                return False
        return True

    def run(self, command: str, steps: list[dict], meta: dict | None = None) -> dict:
        """Start a new run (archiving the finished journal). The caller finishes a pending run first."""
        if self.pending() is not None:
            raise JournalError("an unfinished run is pending", fix="finish it first (this is a driverd bug)")
        self._known(steps)
        for s in steps:
            self.registry[s["action"]].preflight(self.ctx, s.get("params", {}))
        old = self.journal.load(repair=True)
        if old is not None:
            self.journal.archive(old)
        doc = self.journal.new(command, steps, meta)
        self.journal.save(doc)
        return self._continue(doc)

    def resume(self, doc: dict) -> dict:
        doc["resumed"] = doc.get("resumed", 0) + 1
        self.ctx.log(f"finishing the interrupted run {doc['run_id']} ({doc['command']}, {doc['state']}) first")
        return self._continue(doc)

    def preview(self, command: str, steps: list[dict]) -> dict:
        """--dry-run: what a run would do, step by step, without doing it or writing a journal.
        Each step's check() (read-only) tells whether it is already in place."""
        doc = self.pending(repair=False)
        if doc is not None:
            command = f"{doc['command']} (unfinished run {doc['run_id']}, {doc['state']})"
            steps = [s for s in doc["rollback" if doc["state"] == "rolling-back" else "steps"]
                     if s["status"] not in ("done", "skipped")]
        self._known(steps)
        out = []
        for s in steps:
            impl = self.registry[s["action"]]
            params = s.get("params", {})
            try:
                state = "in place" if impl.check(self.ctx, params) else "would run"
            except Exception as e:
                state = f"would run (cannot tell now: {error_record(e)['error']})"
            out.append({"action": s["action"], "description": impl.describe(params), "state": state,
                        "params": params})
            self.ctx.log(f"  {'=' if state == 'in place' else '>'} {impl.describe(params)}: {state}")
        return {"command": command, "dry_run": True, "steps": out}

    def rollback_now(self, doc: dict, reason: str) -> dict:
        """Turn an unfinished forward run into a rollback (driverd rollback while a run is pending)."""
        doc["resumed"] = doc.get("resumed", 0) + 1
        if doc["state"] == "running":
            doc["failure"] = {"step": None, "error": {"error": reason}}
            self._start_rollback(doc)
        return self._continue(doc)

    # -- internals ---------------------------------------------------------------------------
    def _continue(self, doc: dict) -> dict:
        self.ctx.doc = doc
        if doc["state"] == "running":
            for s in doc["steps"]:
                if s["status"] in ("done", "skipped"):
                    continue
                if not self._step(doc, s):
                    self._start_rollback(doc)
                    break
            else:
                return self._finish(doc, "done")
        if doc["state"] == "rolling-back":
            for s in doc["rollback"]:
                if s["status"] in ("done", "skipped"):
                    continue
                if not self._step(doc, s):
                    return self._finish(doc, "rollback-failed")
            return self._finish(doc, "rolled-back")
        return doc

    def _finish(self, doc: dict, state: str) -> dict:
        doc["state"] = state
        doc["finished_at"] = time.time()
        self.journal.save(doc)
        return doc

    def _step(self, doc: dict, s: dict) -> bool:
        # JSON logs carry the step, the run and its command on every line a step logs
        with logs.fields(step=s["action"], run_id=doc["run_id"], command=doc["command"],
                         phase="rollback" if doc["state"] == "rolling-back" else None):
            return self._step_logged(doc, s)

    def _step_logged(self, doc: dict, s: dict) -> bool:
        impl = self.registry[s["action"]]
        params = s.get("params", {})
        resumed = s["status"] == "running"      # interrupted mid-step: its effect may be this run's own
        t0 = time.monotonic()
        try:
            s["status"] = "running"
            s.setdefault("started_at", time.time())
            if "before" not in s:
                paths = impl.preimage(self.ctx, params)
                if paths:
                    s["before"] = {p: _b64(self.ctx.root.read_bytes(p, 64 << 20)) for p in paths}
            self.journal.save(doc)
            if impl.check(self.ctx, params):
                # In place before the run: skipped. In place after an interrupted attempt of this run:
                # done by it, and so part of what a rollback must undo.
                s["status"] = "done" if resumed else "skipped"
                s.setdefault("result", {"completed_before_interruption": True} if resumed else None)
                if s["result"] is None:
                    del s["result"]
                self.ctx.log(f"  = {impl.describe(params)}: already in place")
            else:
                self.ctx.log(f"  > {impl.describe(params)}")
                s["result"] = impl.do(self.ctx, params) or {}
                s["status"] = "done"
        except Exception as e:           # any exception is a failed step, never a run left "running"
            err = error_record(e)
            s["status"] = "failed"
            s["error"] = err
            kernel_log = (err.get("details") or {}).get("kernel_log") or None
            with logs.fields(level="error", status="failed", reason=err.get("error"), kernel_log=kernel_log):
                self.ctx.log(f"  ! {impl.describe(params)} failed: "
                             + (e.one_line() if isinstance(e, DriverdError) else err["error"]))
            key = "failure" if doc["state"] == "running" else "rollback_failure"
            doc[key] = {"step": s["action"], "error": err}
            _timed(s, t0)
            self.journal.save(doc)
            return False
        _timed(s, t0)
        self.journal.save(doc)
        return True

    def _start_rollback(self, doc: dict) -> None:
        rb: list[dict] = []
        touched: set[str] = set()
        for s in reversed(doc["steps"]):
            if s["status"] in ("pending", "skipped"):     # skipped: in place before this run, not ours
                continue
            impl = self.registry[s["action"]]
            touched |= impl.touches
            rb += impl.undo(self.ctx, s.get("params", {}), s)
        if touched:
            rb += self.converge(doc.get("lkg"), touched, self.ctx)
        doc["rollback"] = [{"action": r["action"], "params": r.get("params", {}), "reason": r.get("reason", ""),
                            "status": "pending"} for r in rb]
        doc["state"] = "rolling-back"
        self.journal.save(doc)


def _timed(s: dict, t0: float) -> None:
    """The step's end and its duration: `seconds` is this attempt's own (monotonic, preimage, check and
    do), not finished_at - started_at, which spans an interruption when the step was resumed."""
    s["finished_at"] = time.time()
    s["seconds"] = round(time.monotonic() - t0, 3)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
