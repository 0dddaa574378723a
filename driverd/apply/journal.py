"""The journal: <root>/<state.dir>/journal.json, rewritten atomically (temp + fsync + rename + dir
fsync) before and after every step. A finished run's journal is kept under journal.d/<run_id>.json
when the next run starts, so `driverd status` can always say how the last run ended."""
from __future__ import annotations

import json
import os
import time
import uuid

from driverd.errors import JournalError
from driverd.fsutil import atomic_write_json

SCHEMA = 1
UNFINISHED = ("running", "rolling-back")


class Journal:
    def __init__(self, root, state_dir: str = "/var/lib/driverd") -> None:
        self.root = root
        self.hostpath = f"{state_dir.rstrip('/')}/journal.json"
        self.path = root.path(self.hostpath)

    def load(self) -> dict | None:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(text)
        except ValueError as e:
            # Atomic writes make this impossible short of disk corruption or a foreign writer.
            raise JournalError(f"{self.hostpath} is not valid JSON ({e})", cause="the journal is damaged",
                               fix=f"inspect it, then move it aside (mv {self.hostpath} {self.hostpath}.bad)") from None
        if doc.get("schema") != SCHEMA:
            raise JournalError(f"{self.hostpath} has schema {doc.get('schema')}, this driverd reads {SCHEMA}",
                               fix="finish the run with the driverd that started it")
        return doc

    def save(self, doc: dict) -> None:
        doc["updated_at"] = time.time()
        atomic_write_json(self.path, doc, 0o600)

    def new(self, command: str, steps: list[dict], meta: dict | None = None) -> dict:
        return {"schema": SCHEMA, "run_id": time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6],
                "command": command, "state": "running", "started_at": time.time(), "meta": meta or {},
                "steps": [{"action": s["action"], "params": s.get("params", {}), "reason": s.get("reason", ""),
                           "status": "pending"} for s in steps],
                "rollback": [], "failure": None, "warnings": []}

    def archive(self, doc: dict) -> None:
        d = self.path.parent / "journal.d"
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_json(d / f"{doc.get('run_id', 'unknown')}.json", doc, 0o600)
        os.unlink(self.path)
