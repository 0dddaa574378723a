"""The journal: <root>/<state.dir>/journal.json, rewritten atomically (temp + fsync + rename + dir
fsync) before and after every step. A finished run's journal is kept under journal.d/<run_id>.json
when the next run starts (the last `keep` of them), so `driverd status` can always say how the last
runs ended. A journal that cannot be read is moved aside with its bytes kept, never deleted."""
from __future__ import annotations

import json
import os
import time

from driverd.errors import JournalError

SCHEMA = 1
UNFINISHED = ("running", "rolling-back")
_REQUIRED = ("run_id", "command", "state", "steps")


def step_seconds(entry: dict) -> float | None:
    """How long a journalled step took: the executor's `seconds` (the attempt that finished it), else
    (a journal written before it recorded that) finished_at - started_at; None while it has not ended."""
    if entry.get("seconds") is not None:
        return float(entry["seconds"])
    if entry.get("started_at") and entry.get("finished_at"):
        return max(0.0, entry["finished_at"] - entry["started_at"])
    return None


def run_seconds(doc: dict) -> float | None:
    """How long a run took, from its start to its end (or, unfinished, its last journal write): wall
    time, an interruption included."""
    end = doc.get("finished_at") or doc.get("updated_at")
    return max(0.0, end - doc["started_at"]) if doc.get("started_at") and end else None


def phases(doc: dict) -> dict:
    """A run's duration and each step's (forward steps, then the rollback's), as status and outcomes show them."""
    def rows(steps):
        return [{"action": s["action"], "status": s["status"], "seconds": _r(step_seconds(s))} for s in steps or []]
    return {"seconds": _r(run_seconds(doc)), "steps": rows(doc.get("steps")), "rollback": rows(doc.get("rollback"))}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


class Journal:
    def __init__(self, root, state_dir: str = "/var/lib/driverd", keep: int = 20, log=None) -> None:
        self.root = root
        self.log = log or (lambda msg: None)
        self.state_dir = state_dir.rstrip("/")
        self.hostpath = f"{self.state_dir}/journal.json"
        self.archive_dir = f"{self.state_dir}/journal.d"
        self.keep = keep
        self.warnings: list[str] = []

    def load(self, repair: bool = False) -> dict | None:
        """The current journal. One that is damaged raises JournalError for readers; with `repair`
        (the caller holds the host lock) it is moved aside, a warning says where, and None is
        returned: the next run derives the state from the host's facts instead."""
        raw = self.root.read_bytes(self.hostpath, 64 << 20)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            problem = None if isinstance(doc, dict) and all(k in doc for k in _REQUIRED) else "not a driverd journal"
        except ValueError as e:
            doc, problem = None, f"not valid JSON ({e})"
        if problem is None and doc.get("schema") != SCHEMA:
            raise JournalError(f"{self.hostpath} has schema {doc.get('schema')}, this driverd reads {SCHEMA}",
                               fix="finish the run with the driverd version that started it")
        if problem is None:
            return doc
        if not repair:
            raise JournalError(f"{self.hostpath} is damaged: {problem}",
                               fix="the next driverd command that changes the host moves it aside")
        aside = f"{self.hostpath}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(2).hex()}"
        self.root.atomic_write(aside, raw, 0o600)
        self.root.unlink(self.hostpath)
        msg = (f"the journal {self.hostpath} was damaged ({problem}); its bytes were kept in {aside} and the "
               "state is taken from the host itself")
        self.warnings.append(msg)
        self.log(f"driverd: warning: {msg}")
        return None

    def save(self, doc: dict) -> None:
        doc["updated_at"] = time.time()
        self.root.atomic_write_json(self.hostpath, doc, 0o600)

    def new(self, command: str, steps: list[dict], meta: dict | None = None) -> dict:
        # the run id orders the archive (history, prune): to the microsecond, so that runs of one second
        # keep the order they ran in, not the random suffix's
        now = time.time()
        run_id = f"{time.strftime('%Y%m%dT%H%M%S', time.localtime(now))}.{int(now % 1 * 1e6):06d}-{os.urandom(3).hex()}"
        return {"schema": SCHEMA, "run_id": run_id,
                "command": command, "state": "running", "started_at": time.time(), "meta": meta or {},
                "steps": [{"action": s["action"], "params": s.get("params", {}), "reason": s.get("reason", ""),
                           "status": "pending"} for s in steps],
                "rollback": [], "failure": None, "warnings": list(self.warnings)}

    def archive(self, doc: dict) -> None:
        """Move a finished run into journal.d and keep only the newest `keep` there."""
        self.root.atomic_write_json(f"{self.archive_dir}/{doc.get('run_id', 'unknown')}.json", doc, 0o600)
        self.root.unlink(self.hostpath)
        self.prune()

    def history(self) -> list[str]:
        """Archived run ids, oldest first (run ids start with their UTC-free timestamp)."""
        return sorted(n[:-5] for n in self.root.listdir(self.archive_dir) if n.endswith(".json"))

    def load_archived(self, run_id: str) -> dict | None:
        text = self.root.read_text(f"{self.archive_dir}/{run_id}.json")
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    def prune(self) -> None:
        runs = self.history()
        for run_id in runs[:max(0, len(runs) - max(1, self.keep))]:
            self.root.unlink(f"{self.archive_dir}/{run_id}.json")
