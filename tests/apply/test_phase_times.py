"""Each step's duration in the journal, and the last run's phases in `driverd status` (issue 34): what a
reload's time is spent on, read from the host afterwards."""
from __future__ import annotations

import json
import time

from driverd.apply.executor import Executor
from driverd.apply.journal import Journal, phases, run_seconds, step_seconds
from driverd.apply.step import StepContext, StepImpl
from driverd.errors import ModuleError
from driverd.root import Root
from tests.apply.conftest import drv, journal, status


class _Sleep(StepImpl):
    def __init__(self, action: str, seconds: float, fail: bool = False) -> None:
        self.action, self.seconds, self.fail = action, seconds, fail

    def do(self, ctx, params):
        time.sleep(self.seconds)
        if self.fail:
            raise ModuleError("could not load nvidia: No such device")
        return {}


def _executor(tmp_path, registry) -> Executor:
    root = Root(tmp_path)
    ctx = StepContext(root, None, None, None, None)
    return Executor(ctx, Journal(root), registry, lambda lkg, touched, ctx: [{"action": "start-gpu-daemons"}])


def test_every_step_records_its_own_duration_failed_and_rollback_steps_too(tmp_path):
    reg = {"stop-gpu-daemons": _Sleep("stop-gpu-daemons", 0.3), "unload-modules": _Sleep("unload-modules", 0.0),
           "load-modules": _Sleep("load-modules", 0.15, fail=True), "start-gpu-daemons": _Sleep("start-gpu-daemons", 0.0)}
    doc = _executor(tmp_path, reg).run("reload", [{"action": a} for a in ("stop-gpu-daemons", "unload-modules",
                                                                         "load-modules")])
    assert doc["state"] == "rolled-back"
    took = {s["action"]: s["seconds"] for s in doc["steps"]}
    assert took["stop-gpu-daemons"] >= 0.3 and took["unload-modules"] < 0.1 and took["load-modules"] >= 0.15
    failed = doc["steps"][2]
    assert failed["status"] == "failed" and failed["finished_at"] >= failed["started_at"]
    assert [(s["action"], s["status"]) for s in doc["rollback"]] == [("start-gpu-daemons", "done")]
    assert doc["rollback"][0]["seconds"] is not None
    # the run spans its steps
    assert run_seconds(doc) >= sum(took.values())
    p = phases(doc)
    assert [(r["action"], r["status"]) for r in p["steps"]] == [("stop-gpu-daemons", "done"), ("unload-modules", "done"),
                                                                ("load-modules", "failed")]
    assert p["steps"][0]["seconds"] >= 0.3 and p["rollback"][0]["action"] == "start-gpu-daemons"


def test_a_resumed_step_counts_its_own_attempt_not_the_interruption(tmp_path):
    """A step interrupted by a kill keeps its first started_at; its duration is the attempt that finished it."""
    ex = _executor(tmp_path, {"unload-modules": _Sleep("unload-modules", 0.0)})
    j = ex.journal
    doc = j.new("unload", [{"action": "unload-modules"}])
    doc["started_at"] -= 600
    doc["steps"][0].update(status="running", started_at=time.time() - 600)   # killed 10 min ago, mid-step
    j.save(doc)
    out = ex.resume(ex.pending())
    s = out["steps"][0]
    assert out["state"] == "done" and s["status"] == "done"
    assert s["seconds"] < 60 and s["finished_at"] - s["started_at"] >= 600
    assert step_seconds(s) == s["seconds"] and run_seconds(out) >= 600


def test_a_journal_without_seconds_still_reads(tmp_path):
    """Journals written before durations were recorded: the start and end times stand in."""
    assert step_seconds({"started_at": 100.0, "finished_at": 102.5}) == 2.5
    assert step_seconds({"started_at": 100.0}) is None


def test_status_shows_the_last_reloads_phases_with_their_durations(loaded_host):
    r = drv(loaded_host, "reload")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("reload: done in "), r.stdout
    j = journal(loaded_host)
    assert all(isinstance(s["seconds"], float) for s in j["steps"]), j["steps"]
    st = status(loaded_host)["last_run"]
    assert st["command"] == "reload" and st["seconds"] >= sum(s["seconds"] for s in j["steps"]) - 0.01
    assert [(p["action"], p["seconds"]) for p in st["steps"]] == [(s["action"], s["seconds"]) for s in j["steps"]]
    assert st["rollback"] == []
    text = drv(loaded_host, "status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    head = next(ln for ln in lines if ln.startswith("last run"))
    assert head.startswith(f"last run   reload done in {st['seconds']:.2f}s ({j['run_id']})"), head
    steps = lines[lines.index(head) + 1]
    assert steps == "  steps:    " + ", ".join(
        f"{s['action']} {s['seconds']:.2f}s" + (" (in place)" if s["status"] == "skipped" else "") for s in j["steps"])
    assert "unload-modules" in steps and "load-modules" in steps


def test_status_of_a_failed_run_names_the_failed_step_and_the_rollbacks_phases(loaded_host, packages):
    """A reload whose package switch fails (EIO, injected from the test side): the failed step and the
    rollback's steps, each with its time."""
    r = drv(loaded_host, "reload", "--package", str(packages["new"]), faults={"FAULTS_RAISE": "exchange:EIO:1"})
    assert r.returncode == 3, r.stdout + r.stderr
    st = status(loaded_host)["last_run"]
    assert st["state"] == "rolled-back" and st["rollback"], st
    assert all(p["seconds"] is not None for p in st["steps"] + st["rollback"] if p["status"] != "pending")
    lines = drv(loaded_host, "status").stdout.splitlines()
    steps = next(ln for ln in lines if ln.startswith("  steps:    "))
    assert "install-package" in steps and steps.endswith(" FAILED"), steps     # the steps after it never ran
    rb = next(ln for ln in lines if ln.startswith("  rollback: "))
    done = [p for p in st["rollback"] if p["status"] != "pending"]
    assert [w.split()[0] for w in rb[len("  rollback: "):].split(", ")] == [p["action"] for p in done], rb
    assert all(f"{p['action']} {p['seconds']:.2f}s" in rb for p in done), rb
    assert json.dumps(st)


def test_a_reload_reads_the_pci_bus_for_its_decisions_once(loaded_host, monkeypatch):
    """The steps' decisions of one transaction (which modules, which daemons) read the PCI devices once; the
    validation reads them again (it proves the driver on the host as it is). A reload read them five times."""
    from driverd.apply import lifecycle as lc
    from driverd.config import load
    from driverd.host import pci
    from driverd.runner import Runner
    from driverd.sim import install_backends
    install_backends()
    import sys
    calls = []
    real_scan = pci.scan

    def counted(*a, **k):           # driverd's reads, not the simulated kernel's rendering of its GPUs
        if not sys._getframe(1).f_globals["__name__"].startswith("driverd.sim."):
            calls.append(sys._getframe(1).f_code.co_name)
        return real_scan(*a, **k)
    monkeypatch.setattr(pci, "scan", counted)
    ctx = lc.make_context(Root(loaded_host), Runner(), load(Root(loaded_host), environ={}), "sim")
    out = lc.transact(ctx, lc.lifecycle_request("reload"))
    assert out["state"] == "done" and [s["action"] for s in out["steps"]][-1] == "validate"
    assert len(calls) == 2, len(calls)
    calls.clear()
    assert lc.transact(ctx, lc.lifecycle_request("reload"))["state"] == "done"
    assert len(calls) == 2          # each transaction reads the bus anew
