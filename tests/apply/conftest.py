"""Simulated hosts for the transaction tests, driven through the real command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kmod.conftest import host, kernel_of, packages  # noqa: F401  (fixtures)
from tests.conftest import driverd_env

REPO = Path(__file__).resolve().parents[2]
FAULTS = REPO / "tests" / "faults"


def drv(root, *args, env=None, faults: dict | None = None, timeout=180) -> subprocess.CompletedProcess:
    """Run `driverd CMD --root ROOT ARGS...` in a fresh process (DRIVERD_* from this process dropped).
    `faults` sets the test-side fault injector (tests/faults/sitecustomize.py) for that process."""
    e = driverd_env(drop=("DRIVERD_", "FAULTS_"))
    if faults:
        e["PYTHONPATH"] = os.pathsep.join([str(FAULTS), str(REPO)] + ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e.update({k: str(v) for k, v in faults.items()})
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "driverd", *args, "--root", str(root)],
                          capture_output=True, text=True, env=e, timeout=timeout)


def start(root, *args, env=None) -> subprocess.Popen:
    e = driverd_env(drop=("DRIVERD_", "FAULTS_"))
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "driverd", *args, "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)


def journal(root) -> dict | None:
    p = Path(root) / "var/lib/driverd/journal.json"
    return json.loads(p.read_text()) if p.exists() else None


def history(root) -> list[dict]:
    d = Path(root) / "var/lib/driverd/journal.d"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def status(root) -> dict:
    r = drv(root, "status", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def tree_files(root) -> dict[str, bytes]:
    """Every regular file under a tree with its bytes (for nothing-changed assertions)."""
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read()
    return out


@pytest.fixture
def node(host):
    """The host with a loader configuration (/etc/ld.so.conf including ld.so.conf.d), for a user-space
    install: its `ldconfig -r ROOT` chroots, so these tests run as root (CI does)."""
    from tests.packages import usfake
    usfake.require_ldconfig()
    (host / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (host / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    return host


@pytest.fixture
def loaded_host(host):
    """The 2-GPU host with 535 (open) loaded, daemons running, through driverd itself."""
    r = drv(host, "load")
    assert r.returncode == 0, r.stderr
    return host
