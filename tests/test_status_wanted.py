"""`driverd status`: the wanted state (from the configuration) next to what runs, every difference,
what is happening now (the host-lock holder and the step its run is at, an interrupted run, a
pending reboot) and the daemon's last reconcile - in text and with --json."""
from __future__ import annotations

import json
import time

from driverd.apply.journal import Journal
from driverd.apply.lock import HostLock
from driverd.root import Root
from tests.apply.conftest import drv, status
from tests.daemon.conftest import NEW, OLD, daemons, write_config  # noqa: F401  (fixture)
from tests.kmod.conftest import host, packages  # noqa: F401  (fixtures)


def test_wanted_next_to_running_and_every_difference(host, packages):
    repo = packages["old"].parent
    write_config(host, OLD, repo, extra='[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "18"\n')
    s = status(host)
    w = s["wanted"]
    assert w["driver"] == OLD and w["flavor"] == "open" and w["sources"]["driver.version"].endswith("config.toml")
    assert w["in_sync"] is False and w["differs"] == [f"driver {OLD} is wanted, none is loaded"]
    assert w["config"]["modules.parameters"] == {"nvidia": {"NVreg_EnableGpuFirmware": "18"}}
    assert s["activity"]["state"] == "idle" and s["activity"]["holder"] is None
    assert s["daemon"] is None

    r = drv(host, "apply")
    assert r.returncode == 0, r.stderr
    s = status(host)
    assert s["wanted"]["in_sync"] is True and s["wanted"]["differs"] == []
    text = drv(host, "status").stdout
    assert f"wanted     {OLD} (open) from " in text and "in sync: the host runs what the configuration wants" in text
    assert "activity   idle" in text
    assert text.splitlines()[0] == "now        in sync (judged now, as `driverd plan` does)"   # the live verdict first

    write_config(host, NEW, repo, extra='[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "0"\n')
    s = status(host)
    assert f"driver {NEW} is wanted, {OLD} is loaded" in s["wanted"]["differs"]
    assert f"installed package is {OLD} (open), not {NEW}" in s["wanted"]["differs"]
    assert any(d.startswith("nvidia.NVreg_EnableGpuFirmware:") for d in s["wanted"]["differs"]), s["wanted"]
    text = drv(host, "status").stdout
    assert f"wanted     {NEW} (open)" in text and f"  DIFFERS: driver {NEW} is wanted, {OLD} is loaded" in text
    assert text.splitlines()[0].startswith("now        NOT IN SYNC (judged now"), text


def test_auto_flavour_is_decided_from_the_gpus(host, packages):
    p = host / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f'[driver]\nversion = "{NEW}"\n')
    w = status(host)["wanted"]
    assert w["flavor"] == "auto" and w["flavor_decided"] in ("open", "proprietary") and w["flavor_reason"]
    assert f"wanted     {NEW} (auto: {w['flavor_decided']}) from " in drv(host, "status").stdout


def test_no_driver_configured(host):
    s = status(host)
    assert s["wanted"]["driver"] is None and s["wanted"]["in_sync"] is None
    assert "wanted     no driver.version configured" in drv(host, "status").stdout


def _running_journal(host, command: str, at: int) -> dict:
    """A journal of a run that is at its `at`-th step (0-based) right now."""
    j = Journal(Root(host), "/var/lib/driverd")
    doc = j.new(command, [{"action": "snapshot"}, {"action": "stop-gpu-daemons"}, {"action": "unload-modules"},
                          {"action": "load-modules"}, {"action": "validate"}], {})
    for i, s in enumerate(doc["steps"]):
        s["status"] = "done" if i < at else "running" if i == at else "pending"
    j.save(doc)
    return doc


def test_the_lock_holder_and_the_step_its_run_is_at(host):
    doc = _running_journal(host, "reload", 2)
    lock = HostLock(Root(host), "/var/lib/driverd", "reload").acquire()
    try:
        s = status(host)
        a = s["activity"]
        assert a["state"] == "running"
        assert a["holder"]["command"] == "reload" and a["holder"]["pid"] == __import__("os").getpid()
        assert a["run"] == {**a["run"], "run_id": doc["run_id"], "command": "reload", "state": "running",
                            "step": "unload-modules", "step_number": 3, "steps": 5}
        text = drv(host, "status").stdout
        assert "holds the host lock (taken " in text and f"reload run {doc['run_id']} running, at step 3/5 unload-modules" \
            in text, text
    finally:
        lock.release()
    a = status(host)["activity"]                 # the holder is gone: a killed run, left to the next command
    assert a["state"] == "interrupted" and a["holder"] is None and a["run"]["step"] == "unload-modules"
    assert "activity   interrupted: reload run" in drv(host, "status").stdout


def test_a_pending_reboot_is_activity(host):
    rec = host / "var/lib/driverd/reboot-required.json"
    rec.parent.mkdir(parents=True, exist_ok=True)
    boot = (host / "proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else None
    rec.write_text(json.dumps({"reasons": ["nouveau is in use by the console"], "boot_id": boot_id,
                               "since": time.time()}))
    s = status(host)
    assert s["activity"]["state"] == "reboot-pending" and s["activity"]["reboot_pending"] is True
    assert "activity   waiting for a reboot" in drv(host, "status").stdout


def test_the_daemons_last_reconcile(host, packages, daemons):
    write_config(host, OLD, packages["old"].parent)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    s = status(host)
    dm = s["daemon"]
    assert dm["mode"] == "daemon" and dm["pid"] == d.proc.pid and dm["ready"] is True and not dm["stopped"]
    assert dm["last_reconcile"]["state"] == "converged" and OLD in dm["last_reconcile"]["reason"]
    assert dm["next_reconcile_at"] > time.time()
    text = drv(host, "status").stdout
    assert f"daemon     daemon pid {d.proc.pid}, ready; last reconcile (history) converged " in text, text
    rc, _ = d.stop()
    assert rc == 0
    s = status(host)
    assert s["daemon"]["stopped"] is True and s["daemon"]["last_reconcile"]["state"] == "converged"
    assert f"daemon     daemon pid {d.proc.pid} stopped " in drv(host, "status").stdout
