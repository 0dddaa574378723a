"""The daemon's last reconcile, for `driverd status`: <root>/run/driverd/daemon.json.

Runtime state, so under /run (gone after a reboot, like the process that wrote it), not the state
directory: it changes on every pass, and the state directory of an idle, converged host is never
written. One small atomic write per pass (and one when the daemon stops); read by status only.
"""
from __future__ import annotations

import json
import os
import time

PATH = "/run/driverd/daemon.json"


def write(root, *, mode: str, result=None, next_in_s: float | None = None, stopped: bool = False,
          ready: bool | None = None) -> None:
    doc = {"mode": mode, "pid": os.getpid(), "updated_at": time.time(), "stopped": stopped, "ready": ready,
           "next_reconcile_at": (time.time() + next_in_s) if next_in_s is not None else None}
    if result is not None:
        doc["last_reconcile"] = {"state": result.state, "reason": result.reason, "failure": result.failure,
                                 "started_at": result.started, "finished_at": result.finished,
                                 "runs": [d.get("run_id") for d in result.runs], "loaded": result.loaded}
    else:
        old = read(root)
        doc["last_reconcile"] = (old or {}).get("last_reconcile")
    from driverd.redact import redact_obj
    try:
        # 0644 for `driverd status` run by anyone, so nothing secret in it: reasons quote URLs.
        root.atomic_write_json(PATH, redact_obj(doc), 0o644)
    except Exception:          # status information only: never a reason for a pass to fail
        pass


def read(root) -> dict | None:
    text = root.read_text(PATH)
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
