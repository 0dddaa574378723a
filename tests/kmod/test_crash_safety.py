"""kill -9 at every step boundary of a reload (forward, and a failing one that rolls back), restart,
and the host ends on the new driver or the old one, validated, with a journal that says which."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.kmod.conftest import kernel_of

OLD, NEW, BROKEN = ("535.261.03", "open"), ("550.127.05", "open"), ("550.127.08", "open")


def drv(root, *args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "driverd", args[0], "--root", str(root), *args[1:]], capture_output=True,
                          text=True, env=e, timeout=120)


def final_state(root):
    from driverd.kmod.load import validate
    from driverd.kmod.daemons import select_services
    k = kernel_of(root)
    v = validate(k, None, None)
    doc = json.loads((root / "var/lib/driverd/journal.json").read_text())
    return (v.version, v.flavor), v, doc, select_services(k)


def prepare(root):
    r = drv(root, "load")
    assert r.returncode == 0, r.stderr


def run_scenario(tmp_path, packages, target, n, host_factory):
    root = host_factory(tmp_path / f"n{n}")
    prepare(root)
    trace = tmp_path / f"trace{n}"
    r = drv(root, "reload", "--package", str(packages[target]),
            env={"DRIVERD_TEST_CRASH_AT": str(n), "DRIVERD_TEST_BOUNDARIES": str(trace)})
    return root, r


@pytest.fixture
def host_factory(packages):
    from driverd.packages.install import install
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_host

    def make(path):
        make_host(path, dgx_spec(gpus=2, nvswitches=1, nouveau=False))
        install(Root(path), packages["old"], Runner())
        return path
    return make


@pytest.mark.slow
@pytest.mark.parametrize("target,expect_final,expect_state", [("new", NEW, "done"), ("broken", OLD, "rolled-back")])
def test_kill9_at_every_boundary(tmp_path, packages, host_factory, target, expect_final, expect_state):
    # Count the boundaries of an uninterrupted run.
    root = host_factory(tmp_path / "count")
    prepare(root)
    trace = tmp_path / "count.trace"
    r = drv(root, "reload", "--package", str(packages[target]), env={"DRIVERD_TEST_BOUNDARIES": str(trace)})
    labels = trace.read_text().splitlines()
    assert len(labels) >= 16, labels
    ok = []
    for n in range(1, len(labels) + 1):
        root, r = run_scenario(tmp_path, packages, target, n, host_factory)
        assert r.returncode == -signal.SIGKILL, (n, r.returncode, r.stderr[-500:])
        r2 = drv(root, "reload", "--package", str(packages[target]))   # the restart
        loaded, v, doc, services = final_state(root)
        assert loaded in (OLD, NEW), (n, loaded)
        assert loaded == expect_final, (n, labels[n - 1], loaded, r2.stderr[-800:])
        assert v.ok, (n, v.problems)
        assert doc["state"] == expect_state and doc["resumed"] >= 1, (n, doc["state"])
        assert services.running("nvidia-persistenced") and services.running("nv-fabricmanager")
        ok.append(labels[n - 1])
    print(f"\ncrash-safety {target}: {len(ok)} of {len(labels)} boundaries end {expect_final} ({expect_state})")
    assert len(ok) == len(labels)
