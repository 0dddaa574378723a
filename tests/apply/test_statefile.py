"""The daemon's runtime state file, /run/driverd/daemon.json (issue 30): written 0600 — also over a
file an earlier version left 0644 — read by `driverd status` as root, and named as unreadable (not
silently left out) for anyone else."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

from driverd.apply import statefile
from driverd.root import Root
from tests.conftest import REPO


def _result() -> SimpleNamespace:
    return SimpleNamespace(state="failed", reason="GET https://robot:s3cret@mirror.example/r/index.json: HTTP 401",
                           failure="fetch", started=1.0, finished=2.0, runs=[{"run_id": "r1"}], loaded=None)


def test_written_0600_and_read_back(tmp_path):
    root = Root(tmp_path)
    old = tmp_path / "run/driverd/daemon.json"
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    os.chmod(old, 0o644)                                      # as an earlier version left it
    statefile.write(root, mode="daemon", result=_result(), next_in_s=5, ready=False)
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o600
    doc = statefile.read(root)
    assert doc["last_reconcile"]["state"] == "failed" and "s3cret" not in json.dumps(doc)
    assert doc["last_reconcile"]["reason"].startswith("GET https://mirror.example/r/index.json")
    statefile.write(root, mode="daemon", stopped=True)       # the stop keeps the last reconcile, and 0600
    assert stat.S_IMODE(os.stat(old).st_mode) == 0o600
    assert statefile.read(root)["last_reconcile"]["state"] == "failed"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_another_user_is_told_it_is_roots():
    import shutil
    import tempfile
    from pathlib import Path
    tmp_path = Path(tempfile.mkdtemp(prefix="driverd-statefile.", dir="/tmp"))     # reachable by nobody
    try:
        _as_nobody(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _as_nobody(tmp_path):
    os.chmod(tmp_path, 0o755)
    root = Root(tmp_path)
    statefile.write(root, mode="daemon", result=_result())
    for d in (tmp_path / "run", tmp_path / "run/driverd"):
        os.chmod(d, 0o755)
    code = ("import json, sys; sys.path.insert(0, sys.argv[2]); from driverd.apply import statefile;"
            "from driverd.root import Root; print(json.dumps(statefile.read(Root(sys.argv[1]))))")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(REPO)], capture_output=True, text=True,
                       preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)), cwd="/")
    if r.returncode != 0 and "Permission denied" in r.stderr:
        pytest.skip(f"the interpreter is not usable by nobody here: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert "readable by root only (mode 0600): run driverd status as root" in doc["unreadable"]
    from driverd.cli.lifecycle_cmds import render_daemon
    assert render_daemon(doc) == [f"daemon     state unreadable: {doc['unreadable']}"]
