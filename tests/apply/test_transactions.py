"""The node transaction path through the command line: every mutation is a journalled run, a run that
changes nothing writes nothing, a damaged journal is moved aside, the journal history is bounded,
any exception in a step rolls back, rollback reloads the parameters that were running, bad roots
are errors, and a plan that needs a reboot ends in a recorded, signalled reboot."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.apply.conftest import drv, history, journal, kernel_of, status, tree_files
from tests.conftest import driverd_env

OLD = ("535.261.03", "open")


def write_config(root, text: str) -> None:
    p = Path(root) / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def loaded_params(root, module="nvidia") -> dict:
    return dict(kernel_of(root).modules()[module].parameters)


# -- every mutation is journalled; a run that changes nothing writes nothing ------------------------

def test_install_and_rollback_install_are_journalled_runs(host, packages):
    r = drv(host, "install", str(packages["new"]))
    assert r.returncode == 0, r.stderr
    j = journal(host)
    assert j["command"] == "install" and j["state"] == "done"
    assert [s["action"] for s in j["steps"]] == ["snapshot", "install-package"]
    assert j["lkg"]["installed"]["version"] == OLD[0]
    r = drv(host, "rollback-install")
    assert r.returncode == 0, r.stderr
    assert journal(host)["command"] == "rollback-install" and journal(host)["state"] == "done"
    assert [h["command"] for h in history(host)] == ["install"]
    assert status(host)["installed"]["version"] == OLD[0]


def test_a_run_that_changes_nothing_writes_nothing(loaded_host):
    before = tree_files(loaded_host / "var/lib/driverd")
    for _ in range(3):
        r = drv(loaded_host, "load")
        assert r.returncode == 0, r.stderr
        assert "nothing to do" in r.stdout
    assert tree_files(loaded_host / "var/lib/driverd") == before


def test_runtime_configure_and_revert_are_journalled(host):
    r = drv(host, "runtime", "configure", "--runtime", "containerd", "--restart", "none")
    assert r.returncode == 0, r.stderr
    j = journal(host)
    assert j["command"] == "runtime configure" and j["steps"][0]["action"] == "configure-runtime"
    assert "nvidia" in (host / "etc/containerd/config.toml").read_text()
    again = drv(host, "runtime", "configure", "--runtime", "containerd", "--restart", "none")
    assert again.returncode == 0 and "nothing to do" in again.stdout and journal(host)["run_id"] == j["run_id"]
    r = drv(host, "runtime", "revert", "--restart", "none")
    assert r.returncode == 0, r.stderr
    assert journal(host)["command"] == "runtime revert"


# -- journal hygiene --------------------------------------------------------------------------------

def test_damaged_journal_is_moved_aside_with_its_bytes(loaded_host):
    jp = loaded_host / "var/lib/driverd/journal.json"
    jp.write_bytes(b'{"schema": 1, "run_id": "x", "state": "runn')     # torn by a foreign writer
    st = drv(loaded_host, "status", "--json")
    assert st.returncode == 0 and "damaged" in json.loads(st.stdout)["journal_problem"]
    r = drv(loaded_host, "unload")
    assert r.returncode == 0, r.stderr
    aside = list(jp.parent.glob("journal.json.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == b'{"schema": 1, "run_id": "x", "state": "runn'
    assert "damaged" in r.stderr and str(aside[0].name) in r.stderr
    assert journal(loaded_host)["command"] == "unload" and journal(loaded_host)["state"] == "done"
    assert any("damaged" in w for w in journal(loaded_host)["warnings"])


def test_journal_history_is_pruned_to_the_configured_count(loaded_host):
    write_config(loaded_host, "[state]\njournal_keep = 3\n")
    for _ in range(3):
        assert drv(loaded_host, "unload").returncode == 0
        assert drv(loaded_host, "load").returncode == 0
    runs = history(loaded_host)
    assert len(runs) == 3, [r["run_id"] for r in runs]
    assert journal(loaded_host)["command"] == "load"


def test_runs_of_one_second_are_archived_and_pruned_in_the_order_they_ran(tmp_path, monkeypatch):
    """Run ids order journal.d (history, prune, the last run status names): runs started within one second
    (a command right after another) must keep the order they ran in, whatever their random suffix."""
    import time
    import types

    from driverd.apply import journal as jmod
    from driverd.root import Root
    ticks = iter(1_790_000_000.0 + i * 0.001 for i in range(100))
    # the journal module's clock, from the test side: every run within the same second
    monkeypatch.setattr(jmod, "time", types.SimpleNamespace(time=lambda: next(ticks), localtime=time.localtime,
                                                           strftime=time.strftime))
    j = jmod.Journal(Root(tmp_path), keep=8)
    ran = []
    for i in range(30):
        doc = j.new("load" if i % 2 else "reload", [])
        j.archive(doc)
        ran.append(doc["run_id"])
    assert len({r[:15] for r in ran}) == 1                  # one second
    assert j.history() == ran[-8:]                           # the newest kept, oldest first


# -- any exception is a failed step ----------------------------------------------------------------

def test_malformed_installed_manifest_fails_the_step_and_rolls_back(loaded_host):
    man = next((loaded_host / "lib/modules").glob("*/updates/driverd/manifest.json"))
    man.write_text('{"flavor": "open"}')            # damaged: no "driver"
    r = drv(loaded_host, "reload")
    assert r.returncode == 3, r.stderr
    j = journal(loaded_host)
    assert j["state"] == "rolled-back" and j["failure"]["step"] == "load-modules"
    assert "no driver package is installed" in r.stderr and "Traceback" not in r.stderr
    assert kernel_of(loaded_host).is_loaded("nvidia")          # back on what was running


def test_an_unexpected_exception_inside_a_step_rolls_back(loaded_host, packages):
    # EIO on the package switch, injected from the test side: a plain OSError, not a driverd error.
    r = drv(loaded_host, "reload", "--package", str(packages["new"]), faults={"FAULTS_RAISE": "exchange:EIO:1"})
    assert r.returncode == 3, r.stdout + r.stderr
    j = journal(loaded_host)
    assert j["state"] == "rolled-back" and j["failure"]["step"] == "install-package"
    assert "Input/output error" in j["failure"]["error"]["error"]
    st = status(loaded_host)
    assert st["loaded"]["version"] == OLD[0] and st["installed"]["version"] == OLD[0]


def _unshare() -> str:
    exe = shutil.which("unshare")
    if exe is None or subprocess.run([exe, "-m", "true"]).returncode != 0:
        pytest.skip("needs unshare -m (mount namespaces) to make a real read-only or full file system")
    return exe


def drv_in_namespace(root, setup: str, *args) -> subprocess.CompletedProcess:
    """driverd in a private mount namespace after `setup` (mount commands) ran there."""
    import os
    import sys
    env = driverd_env()
    cmd = " ".join(["exec", sys.executable, "-m", "driverd"] + [f"'{a}'" for a in args] + ["--root", str(root)])
    return subprocess.run([_unshare(), "-m", "sh", "-c", f"set -e; {setup}; {cmd}"], capture_output=True,
                          text=True, env=env, timeout=180)


def test_read_only_etc_fails_the_apply_and_changes_nothing(tmp_path, packages):
    from driverd.sim.scenario import dgx_spec, make_host
    root = make_host(tmp_path / "h", dgx_spec(gpus=2, nvswitches=0, nouveau=True))
    write_config(root, f'[driver]\nversion = "{OLD[0]}"\nflavor = "open"\n'
                       f'[packages]\nrepositories = ["file://{packages["old"].parent}"]\n')
    before = tree_files(root / "etc")
    etc = root / "etc"
    r = drv_in_namespace(root, f"mount --bind {etc} {etc}; mount -o remount,ro,bind {etc}", "apply")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Read-only file system" in r.stderr and "Traceback" not in r.stderr
    j = journal(root)
    assert j["state"] == "rolled-back" and j["failure"]["step"] == "blacklist-nouveau"
    assert tree_files(root / "etc") == before


def test_disk_full_during_install_fails_cleanly_and_keeps_the_old_package(loaded_host, packages):
    mods = next((loaded_host / "lib/modules").glob("*/updates"))
    # A small tmpfs over updates/ with what is there, then filled up: a real ENOSPC for the new files.
    setup = (f"tar -C {mods} -cf {mods.parent}/.mods.tar . && mount -t tmpfs -o size=4m tmpfs {mods} "
             f"&& tar -C {mods} -xf {mods.parent}/.mods.tar && rm {mods.parent}/.mods.tar "
             f"&& (dd if=/dev/zero of={mods}/.fill bs=4k 2>/dev/null || true)")
    r = drv_in_namespace(loaded_host, setup, "reload", "--package", str(packages["new"]))
    assert r.returncode == 3, r.stdout + r.stderr
    assert ("disk full" in r.stderr or "No space left" in r.stderr) and "Traceback" not in r.stderr
    j = journal(loaded_host)
    assert j["state"] == "rolled-back", j["state"]
    k = kernel_of(loaded_host)
    assert k.is_loaded("nvidia")


# -- rollback restores what was running ------------------------------------------------------------

def test_bad_parameter_value_is_refused_before_anything_is_unloaded(loaded_host):
    write_config(loaded_host, "[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = \"maybe\"\n")
    before = journal(loaded_host)["run_id"]
    r = drv(loaded_host, "reload")
    assert r.returncode == 3, r.stderr
    assert "NVreg_EnableGpuFirmware='maybe'" in r.stderr and "int" in r.stderr
    j = journal(loaded_host)
    assert j["run_id"] != before and j["failure"]["step"] == "check-parameters"
    assert [s["action"] for s in j["steps"] if s["status"] == "done"] == ["snapshot"]
    assert kernel_of(loaded_host).is_loaded("nvidia")               # never unloaded


def test_rollback_reloads_the_parameters_that_were_running(host, packages):
    write_config(host, "[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = \"18\"\n")
    assert drv(host, "load").returncode == 0
    assert loaded_params(host)["NVreg_EnableGpuFirmware"] == "18"
    write_config(host, "[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = \"0\"\n")   # valid, new
    r = drv(host, "reload", "--package", str(packages["broken"]))
    assert r.returncode == 3 and journal(host)["state"] == "rolled-back", r.stderr
    assert journal(host)["lkg"]["parameters"]["nvidia"]["NVreg_EnableGpuFirmware"] == "18"
    assert loaded_params(host)["NVreg_EnableGpuFirmware"] == "18"   # what ran before, not the new config


def test_a_rollback_says_the_daemon_brings_driver_version_back_and_pin_keeps_the_rolled_back_one(host, packages):
    """Issue 42: with driver.version naming the driver rolled back from, the daemon's next pass (or
    `driverd apply`) upgrades again: the rollback says so; --pin writes the rolled-back version into the
    configuration file, keeping every other line."""
    new = json.loads(drv(host, "install", str(packages["new"]), "--json").stdout or "{}")
    assert drv(host, "load").returncode == 0
    new_version = status(host)["loaded"]["version"]
    assert new_version != OLD[0], new
    write_config(host, f'# ours\n[driver]\nversion = "{new_version}"  # the fleet\'s\n[runtime]\nrestart = "none"\n')
    cfg = host / "etc/driverd/config.toml"
    r = drv(host, "rollback")
    assert r.returncode == 0, r.stderr
    assert status(host)["loaded"]["version"] == OLD[0]
    assert f"driver.version still names {new_version}" in r.stdout and "driverd rollback --pin" in r.stdout, r.stdout
    assert f'version = "{new_version}"' in cfg.read_text()          # nothing written without --pin
    # back on the new one, then a rollback that pins
    assert drv(host, "rollback").returncode == 0 and status(host)["loaded"]["version"] == new_version
    r = drv(host, "rollback", "--pin", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["pinned"] == {"driver.version": OLD[0], "file": str(cfg), "was": new_version}
    text = cfg.read_text()
    assert f'version = "{OLD[0]}"' in text and "# ours" in text and 'restart = "none"' in text, text
    assert status(host)["wanted"]["driver"] == OLD[0]        # what the daemon and apply now reconcile to


# -- bad roots ------------------------------------------------------------------------------------

def test_bad_roots_are_usage_errors(tmp_path):
    r = drv(tmp_path / "nonexistent", "plan", "--driver", "535.261.03")
    assert r.returncode == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    f = tmp_path / "file"
    f.write_text("")
    r = drv(f, "detect")
    assert r.returncode == 2 and "is not a directory" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = drv(empty, "detect")
    assert r.returncode == 2 and r.stderr.strip() == (
        f"driverd: error: --root {empty} is not a host's root: it has no proc, sys or etc/os-release; fix: pass the "
        "directory holding the host's root file system (/ on a host, /host in the driver container)")


def test_a_root_one_level_too_high_is_refused_naming_the_root_below(tmp_path):
    """`plan --root` one level too high exited 0 with "no NVIDIA GPU on this host" and kernel None (issue 32)."""
    from driverd.sim.hosttree import HostSpec, h100, write_host
    write_host(tmp_path / "host", HostSpec(pci=[h100("0000:1b:00.0")]))
    (tmp_path / "notes").mkdir()
    for cmd in (("plan", "--driver", "535.261.03"), ("detect",), ("status",)):
        r = drv(tmp_path, *cmd)
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stdout == "" and r.stderr.strip() == (
            f"driverd: error: --root {tmp_path} is not a host's root: it has no proc, sys or etc/os-release; "
            f"fix: pass --root {tmp_path / 'host'}, which looks like one")
    # what a host root has is enough, whichever of it: os-release only (/proc not mounted), proc and sys only
    osr = tmp_path / "osr"
    (osr / "usr/lib").mkdir(parents=True)
    (osr / "usr/lib/os-release").write_text("ID=debian\n")
    (osr / "etc").mkdir()
    (osr / "etc/os-release").symlink_to("../usr/lib/os-release")
    assert drv(osr, "detect").returncode == 0
    assert drv(tmp_path / "host", "plan", "--driver", "535.261.03").returncode in (0, 3)


# -- reboot as an outcome ----------------------------------------------------------------------------

def test_reboot_required_is_recorded_signalled_and_cleared_after_the_reboot(tmp_path, packages):
    from driverd.sim.scenario import dgx_spec, make_host
    root = make_host(tmp_path / "h", dgx_spec(gpus=2, nvswitches=0, nouveau=True, nouveau_in_use=True))
    write_config(root, f'[driver]\nversion = "{OLD[0]}"\nflavor = "open"\n'
                       f'[packages]\nrepositories = ["file://{packages["old"].parent}"]\n'
                       '[runtime]\nrestart = "none"\n')
    r = drv(root, "apply")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "REBOOT REQUIRED" in r.stdout and "nouveau is loaded and in use" in r.stdout
    from driverd.root import Root
    sentinel = Root(root).real("/var/run/reboot-required")
    assert sentinel.read_text() == "*** System restart required ***\n"
    j = journal(root)
    done = [s["action"] for s in j["steps"] if s["status"] == "done"]
    assert "install-package" in done and "blacklist-nouveau" in done and "require-reboot" in done
    assert not any(a in done for a in ("unload-nouveau", "load-modules", "unload-modules"))
    st = status(root)
    assert "nouveau" in st["reboot_required"]["reasons"][0] and st["installed"]["version"] == OLD[0]
    again = drv(root, "apply")                                       # still before the reboot
    assert again.returncode == 4 and journal(root)["run_id"] == j["run_id"]
    kernel_of(root).reboot()                                         # nouveau stays out: it is blacklisted
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert status(root)["loaded"]["version"] == OLD[0] and status(root)["reboot_required"] is None
    assert not sentinel.exists()


def test_runtime_restart_that_fails_after_the_write_restores_the_config_byte_identical(host):
    cfg = host / "etc/containerd/config.toml"
    before = cfg.read_bytes()
    r = drv(host, "runtime", "configure", "--runtime", "containerd", "--restart", "systemd",
            faults={"FAULTS_FAIL_CALL": "driverd.runtime.restart:restart_or_raise"})
    assert r.returncode == 3, r.stdout + r.stderr
    j = journal(host)
    assert j["state"] == "rolled-back" and j["failure"]["step"] == "configure-runtime"
    assert "injected failure" in j["failure"]["error"]["error"]
    assert j["rollback"][0]["action"] == "restore-files" and j["rollback"][0]["status"] == "done"
    assert cfg.read_bytes() == before
    assert not (host / "var/lib/driverd/runtime/state.json").exists()


def test_a_command_after_an_interrupted_run_says_it_finishes_that_run_first(loaded_host, packages):
    # Killed right after the unload (from the test side): the journal says "running".
    trace = loaded_host.parent / "trace"
    drv(loaded_host, "reload", "--package", str(packages["new"]),
        faults={"FAULTS_TRACE": trace, "FAULTS_UNDER": loaded_host})
    n = next(int(ln.split()[0]) for ln in trace.read_text().splitlines() if "kernel unload nvidia" in ln)
    assert drv(loaded_host, "reload").returncode == 0                       # back to a loaded driver
    r = drv(loaded_host, "reload", "--package", str(packages["old"]), faults={"FAULTS_KILL_AFTER": n,
                                                                            "FAULTS_UNDER": loaded_host})
    assert r.returncode < 0 and journal(loaded_host)["state"] == "running"
    st = status(loaded_host)
    assert st["last_run"]["unfinished"] and st["lock_holder"] is None
    r = drv(loaded_host, "apply", "--driver", "535.261.03", "--flavor", "open")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "finishing the interrupted run" in r.stderr and "first finished the interrupted reload run" in r.stdout
    assert history(loaded_host)[-1]["command"] == "reload" and history(loaded_host)[-1]["state"] == "done"


def test_a_refused_unload_keeps_the_working_driver_and_says_so(loaded_host):
    """A process holds the GPU: the unload is refused before anything is unloaded, and the run ends
    rolled back with the driver as it was — validated, not 'ROLLBACK FAILED' after a second refused
    unload (what Debian's 6.1 kernel showed in tests/vm, and the simulated kernel the same)."""
    k = kernel_of(loaded_host)
    pid = k.spawn("python3", ["/dev/nvidia0"], cmdline="python3 train.py")
    try:
        r = drv(loaded_host, "unload")
        assert r.returncode == 3, r.stderr
        assert f"pid {pid}" in r.stderr and "ROLLBACK FAILED" not in r.stderr, r.stderr
        j = journal(loaded_host)
        assert j["state"] == "rolled-back" and j["failure"]["step"] == "unload-modules", j["state"]
        assert [s["action"] for s in j["rollback"]][-1] == "validate"
        assert "unload-modules" not in [s["action"] for s in j["rollback"]]
        assert k.is_loaded("nvidia") and k.alive(pid)
    finally:
        k.signal(pid, 9)


# -- what a failed or rolled-back run says (issue 32) ---------------------------------------------------

def test_a_requested_rollback_of_an_interrupted_run_succeeds_and_says_what_it_restored(loaded_host, packages):
    """`driverd rollback` after a killed reload exited 3 with "error: reload failed: rollback requested":
    a rollback that was asked for and worked exits 0 and names the driver it went back to."""
    trace = loaded_host.parent / "trace"
    drv(loaded_host, "reload", "--package", str(packages["new"]), faults={"FAULTS_TRACE": trace, "FAULTS_UNDER": loaded_host})
    n = next(int(ln.split()[0]) for ln in trace.read_text().splitlines() if "kernel unload nvidia" in ln)
    assert drv(loaded_host, "reload", "--package", str(packages["old"])).returncode == 0      # back on 535
    r = drv(loaded_host, "reload", "--package", str(packages["new"]), faults={"FAULTS_KILL_AFTER": n,
                                                                            "FAULTS_UNDER": loaded_host})
    assert r.returncode < 0 and journal(loaded_host)["state"] == "running"      # killed after the unload
    run_id = journal(loaded_host)["run_id"]
    r = drv(loaded_host, "rollback")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "error" not in r.stderr and "rollback requested" not in r.stdout + r.stderr
    assert f"rollback: the interrupted reload run {run_id}: rolled back to {OLD[0]} ({OLD[1]}), validated" in r.stdout
    assert journal(loaded_host)["state"] == "rolled-back" and status(loaded_host)["loaded"]["version"] == OLD[0]
    r = drv(loaded_host, "rollback", "--json")       # nothing pending now: back to the previous package
    assert r.returncode in (0, 3) and "rollback requested" not in r.stdout + r.stderr


def test_a_run_that_failed_before_changing_anything_does_not_claim_a_rollback(loaded_host):
    """An apply whose fetch fails first thing said "rolled back to 535.261.03 (open), validated": nothing
    had changed and no validation ran. It says so; a run that undid a change says what it undid."""
    write_config(loaded_host, '[packages]\nrepositories = ["file:///nonexistent/driverd"]\n')
    r = drv(loaded_host, "apply", "--driver", "550.127.05", "--flavor", "open")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "apply: failed at fetch-package; rolled back to the state before the run (blacklist-nouveau undone)" in r.stdout
    assert "validated" not in r.stdout + r.stderr.splitlines()[-1]
    # nouveau blacklisted already (by hand): the fetch is the first step that would change anything
    (loaded_host / "etc/modprobe.d/blacklist-nouveau.conf").write_text("blacklist nouveau\noptions nouveau modeset=0\n")
    before = tree_files(loaded_host / "etc")
    r = drv(loaded_host, "apply", "--driver", "550.127.05", "--flavor", "open")
    assert r.returncode == 3
    assert "apply: failed at fetch-package; nothing was changed" in r.stdout
    line = r.stderr.splitlines()[-1]
    assert line.startswith("driverd: error: apply failed at fetch-package: cannot read the package repository: "
                           "file:///nonexistent/driverd (") and "; nothing was changed;" in line
    assert "rolled back" not in line and "validated" not in line
    assert tree_files(loaded_host / "etc") == before


def test_runtime_configure_on_a_broken_containerd_toml_is_bad_input_and_changes_nothing(loaded_host):
    """It reported a driver rollback ("rolled back to 535.261.03 (open), validated", exit 3): the file, the
    line and column and the TOML error, nothing written, exit 2 — refused before any run is journalled."""
    cfg = loaded_host / "etc/containerd/config.toml"
    cfg.write_text('version = 2\n[plugins\n')
    before, run_id = tree_files(loaded_host), journal(loaded_host)["run_id"]
    for extra in ((), ("--dry-run",)):
        r = drv(loaded_host, "runtime", "configure", "--runtime", "containerd", "--restart", "none", *extra)
        assert r.returncode == 2, r.stdout + r.stderr
        [line] = r.stderr.splitlines()
        assert line.startswith("driverd: error: /etc/containerd/config.toml is not valid TOML (line 2, column ")
        assert "cause: " in line and "driverd wrote nothing" in line
        assert "rolled back" not in line and "validated" not in line and "Traceback" not in line
    assert tree_files(loaded_host) == before and journal(loaded_host)["run_id"] == run_id
