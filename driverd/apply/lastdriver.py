"""The driver driverd last converged this host to, in cluster mode: <state.dir>/node-driver.json.

Cluster mode needs to tell a host that joins the cluster (driverd has never given it a driver: it
serves no GPU work, so it may install its desired driver at once) from one that runs — or ran before
a reboot or a kernel update unloaded it — a driver driverd manages (that one keeps its driver until a
rollout admits it). What is loaded says it while a driver runs; this record says it after a reboot,
when nothing is loaded yet and the package for a new kernel may not be installed either. Written
only when it changes (an idle, converged host's state directory is not written), mode 0600 like
the journal.
"""
from __future__ import annotations

import json

NAME = "node-driver.json"
MODE = 0o600


def _path(state_dir: str) -> str:
    return f"{state_dir.rstrip('/')}/{NAME}"


def read(root, state_dir: str) -> dict | None:
    """{"version", "flavor"} of the driver last converged to, or None (never, or an unreadable record:
    then what is loaded or installed decides)."""
    text = root.read_text(_path(state_dir))
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("version"), str) or not doc["version"]:
        return None
    return {"version": doc["version"], "flavor": str(doc.get("flavor") or "")}


def write(root, state_dir: str, loaded: dict) -> bool:
    """Record `loaded` ({"version", "flavor"}) unless it is recorded already; whether it wrote."""
    want = {"version": loaded["version"], "flavor": loaded.get("flavor") or ""}
    if read(root, state_dir) == want:
        return False
    root.atomic_write_json(_path(state_dir), want, MODE)
    return True
