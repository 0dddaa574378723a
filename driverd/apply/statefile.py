"""The daemon's last reconcile, for `driverd status`: <root>/run/driverd/daemon.json.

Runtime state, so under /run (gone after a reboot, like the process that wrote it), not the state
directory: it changes on every pass, and the state directory of an idle, converged host is never
written. One small atomic write per pass (and one when the daemon stops), mode 0600 (root's, like
the daemon); read by status only.
"""
from __future__ import annotations

import json
import os
import time

PATH = "/run/driverd/daemon.json"
MODE = 0o600


def write(root, *, mode: str, result=None, next_in_s: float | None = None, stopped: bool = False,
          ready: bool | None = None) -> None:
    doc = {"mode": mode, "pid": os.getpid(), "updated_at": time.time(), "stopped": stopped, "ready": ready,
           "next_reconcile_at": (time.time() + next_in_s) if next_in_s is not None else None}
    if result is not None:
        doc["last_reconcile"] = {"state": result.state, "reason": result.reason, "failure": result.failure,
                                 "started_at": result.started, "finished_at": result.finished,
                                 "runs": [d.get("run_id") for d in result.runs], "loaded": result.loaded,
                                 "degraded": getattr(result, "degraded", None)}
        if getattr(result, "pinned", None):
            doc["cluster"] = result.pinned
    kernels = getattr(result, "kernels", None) if result is not None else None
    old = read(root) if result is None or kernels is None else None
    if result is None:
        doc["last_reconcile"] = (old or {}).get("last_reconcile")
        if (old or {}).get("cluster"):
            doc["cluster"] = old["cluster"]
    # the kernel watch's report (driverd.apply.kernelprep): `driverd status` and `driverd reboot-ready` say it
    doc["kernels"] = kernels if kernels is not None else (old or {}).get("kernels")
    from driverd.redact import redact_obj
    try:
        # 0600 (issue 30): reasons quote repository URLs and errors; redacted, but what a pass says about
        # the host is root's to read. `driverd status` runs as root; as another user it says so.
        root.atomic_write_json(PATH, redact_obj(doc), MODE)
    except Exception:          # status information only: never a reason for a pass to fail
        pass


def read(root) -> dict | None:
    """The last state written; None when there is none. A file this user may not read (it is 0600,
    root's) gives {"unreadable": reason} so that status can say so instead of showing nothing."""
    text = root.read_text(PATH)
    if text is None and root.is_file(PATH):
        real = root.real(PATH)
        if not os.access(real, os.R_OK):
            return {"unreadable": f"{real} is readable by root only (mode 0600): run driverd status as root"}
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
