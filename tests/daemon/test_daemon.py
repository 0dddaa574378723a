"""`driverd daemon` end to end on a simulated host: converge and go READY, follow a config change
(a driver upgrade through the transaction path), re-read on SIGHUP (a module parameter change is a
reload), report a blocked plan without crashing and retry it, keep the previous configuration when
the new one is broken, and stop on SIGTERM within 10 s - abandoning a step when it must, with the
journal making the run resumable by the next start."""
from __future__ import annotations

import json
import re
import signal
import time

from driverd.sim.scenario import RELEASE
from tests.apply.conftest import tree_files
from tests.daemon.conftest import NEW, OLD, journal_runs, kernel_of, write_config


def _done_steps(run: dict) -> list[str]:
    return [s["action"] for s in run["steps"] if s["status"] == "done"]


def test_daemon_converges_follows_a_config_change_and_stops_on_sigterm(host, packages, daemons):
    repo = packages["old"].parent
    write_config(host, OLD, repo)
    d = daemons(host, watchdog_usec=1_000_000)
    _, ready = d.wait_notify("READY=1", 60)
    assert f"STATUS=converged: driver {OLD} (open) loaded and validated" in ready
    before_ready = d.all_messages[:d.all_messages.index(ready)]
    assert any(m.startswith("STATUS=reconciling") for m in before_ready)
    assert d.get("/healthz") == (200, "ok\n")
    code, body = d.get("/readyz")
    assert code == 200 and OLD in body and body.startswith("ready: ")
    assert d.metric("driverd_driver_info", version=OLD, flavor="open", kernel=RELEASE) == 1
    assert d.metric("driverd_ready") == 1
    assert d.metric("driverd_state", state="converged") == 1
    assert d.metric("driverd_reconciles_total", result="converged") == 1
    assert d.metric("driverd_transaction_duration_seconds_count", command="apply", state="done") == 1
    assert d.metric("driverd_step_duration_seconds_count", action="load-modules", status="done") == 1
    assert [r["command"] for r in journal_runs(host)] == ["apply"]

    write_config(host, NEW, repo)                       # the file changes: no signal needed
    d.wait_log(r"converged: driver 550\.127\.05 \(open\)", 60)
    code, body = d.get("/readyz")
    assert code == 200 and NEW in body
    runs = journal_runs(host)
    assert [r["command"] for r in runs] == ["apply", "apply"] and runs[-1]["state"] == "done"
    assert {"fetch-package", "install-package", "stop-gpu-daemons", "unload-modules", "load-modules",
            "validate"} <= set(_done_steps(runs[-1]))
    assert d.metric("driverd_driver_info", version=NEW, flavor="open", kernel=RELEASE) == 1
    assert d.metric("driverd_driver_info", version=OLD, flavor="open", kernel=RELEASE) is None
    assert d.metric("driverd_reconciles_total", result="converged") == 2
    assert d.metric("driverd_config_reloads_total", result="ok") == 1
    assert kernel_of(host).modules()["nvidia"].version == NEW

    rc, took = d.stop()
    assert rc == 0 and took < 10, d.log
    d.wait_notify("STOPPING=1", 5)
    assert sum("READY=1" in m for m in d.all_messages) == 1
    assert sum(m == "WATCHDOG=1" for m in d.all_messages) >= 2
    assert "Traceback" not in d.log


def test_sighup_rereads_the_config_and_a_parameter_change_reloads(host, packages, daemons):
    repo = packages["old"].parent
    write_config(host, OLD, repo, check_s=0)            # no file checks: only SIGHUP re-reads
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    state = tree_files(host / "var/lib/driverd")
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"SIGHUP: configuration re-read", 10, start=n)
    d.wait_log(r"converged: .*nothing changed", 30, start=n)
    assert tree_files(host / "var/lib/driverd") == state        # a reconcile with nothing to do writes nothing

    write_config(host, OLD, repo, check_s=0, extra='[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "18"\n')
    time.sleep(1.5)
    assert kernel_of(host).modules()["nvidia"].parameters.get("NVreg_EnableGpuFirmware") != "18"
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"module parameters differ from the configuration: nvidia\.NVreg_EnableGpuFirmware", 30, start=n)
    d.wait_log(r"converged: driver 535\.261\.03", 30, start=n)
    assert kernel_of(host).modules()["nvidia"].parameters["NVreg_EnableGpuFirmware"] == "18"
    runs = journal_runs(host)
    assert runs[-1]["command"] == "reload" and runs[-1]["state"] == "done"
    assert d.get("/readyz")[0] == 200

    (host / "etc/driverd/config.toml").write_text("[driver\nversion = 1\n")
    n = len(d.lines)
    d.signal(signal.SIGHUP)
    d.wait_log(r"cannot be used: .*not valid TOML.*keeping the previous one", 10, start=n)
    assert d.get("/readyz")[0] == 200                              # the host is still as configured before
    assert d.metric("driverd_config_reloads_total", result="error") == 1
    assert d.proc.poll() is None
    rc, took = d.stop()
    assert rc == 0 and took < 10


def test_a_blocked_plan_is_reported_and_retried_never_a_crash(host, packages, daemons):
    repo = packages["old"].parent
    write_config(host, OLD, repo)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    k = kernel_of(host)
    pid = k.spawn("python3", ["/dev/nvidiactl", "/dev/nvidia0"], cmdline="python3 train.py")
    runs = len(journal_runs(host))
    n = len(d.lines)
    write_config(host, NEW, repo)
    d.wait_log(rf"not converged: blocked: .*the GPU is in use by pid {pid} \(python3\).*retrying in", 30, start=n)
    # OLD still runs, validated: the node stays ready on it, degraded (issue 32), saying what blocks NEW
    code, body = d.get("/readyz")
    assert code == 200 and body.startswith(f"ready: degraded: driver {OLD} (open) loaded and validated, not the "
                                           f"wanted {NEW} (retrying): blocked: ") and f"pid {pid}" in body, body
    assert body.count("\n") == 1
    assert d.metric("driverd_ready") == 1 and d.metric("driverd_state", state="blocked") == 1
    assert d.metric("driverd_degraded") == 1
    d.wait_log(rf"not converged: blocked: .*pid {pid}", 10, start=len(d.lines))    # retried, still alive
    assert d.metric("driverd_reconcile_failures_total", reason="blocked") >= 2
    _, status = d.wait_notify("STATUS=degraded", 10)
    assert f"pid {pid}" in status and "retry in" in status
    assert len(journal_runs(host)) == runs                          # a blocked plan writes no journal
    assert d.proc.poll() is None

    kernel_of(host).signal(pid, signal.SIGKILL)                    # the job ends
    d.wait_log(r"converged: driver 550\.127\.05", 30)
    assert d.get("/readyz")[0] == 200 and d.metric("driverd_degraded") == 0
    rc, _ = d.stop()
    assert rc == 0


def test_a_failed_upgrade_rolls_back_and_is_reported(host, packages, daemons):
    write_config(host, OLD, packages["old"].parent)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    n = len(d.lines)
    broken = packages["broken"]                     # 550.127.08 without its GSP firmware: the load fails
    write_config(host, "550.127.08", broken.parent)
    d.wait_log(r"not converged: failed: apply failed at .*rolled back to 535\.261\.03 \(open\), validated.*"
               r"retrying in 2s", 60, start=n)
    code, body = d.get("/readyz")                   # back on OLD, validated: ready, degraded (issue 32)
    assert code == 200 and body.startswith(f"ready: degraded: driver {OLD} (open) loaded and validated, not the "
                                           "wanted 550.127.08 (retrying): failed: apply failed at ") and \
        body.count("\n") == 1, body
    assert d.metric("driverd_reconcile_failures_total", reason="rolled-back") >= 1
    assert d.metric("driverd_transaction_duration_seconds_count", command="apply", state="rolled-back") >= 1
    assert d.metric("driverd_driver_info", version=OLD, flavor="open", kernel=RELEASE) == 1   # last converge
    assert kernel_of(host).modules()["nvidia"].version == OLD                              # back on the LKG
    assert d.proc.poll() is None
    assert d.stop()[0] == 0


def test_sigterm_inside_a_long_step_exits_0_and_the_next_start_finishes_the_run(host, packages, daemons):
    repo = packages["old"].parent
    slow = '[modules]\nunload_policy = "terminate"\nterminate_grace_s = 120\n'
    write_config(host, OLD, repo, extra=slow)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    pid = kernel_of(host).spawn("stubborn", ["/dev/nvidia0"], ignores_sigterm=True)   # waits out the grace period
    n = len(d.lines)
    write_config(host, NEW, repo, extra=slow)
    d.wait_log(r"> unload the NVIDIA modules", 30, start=n)
    time.sleep(0.5)
    rc, took = d.stop()
    assert rc == 0 and took < 10, d.log
    assert "abandoning the current reconcile" in d.log
    j = json.loads((host / "var/lib/driverd/journal.json").read_text())
    assert j["state"] == "running" and j["command"] == "apply"

    kernel_of(host).signal(pid, signal.SIGKILL)
    d2 = daemons(host)
    d2.wait_notify("READY=1", 60)
    d2.wait_log(re.escape(f"finishing the interrupted run {j['run_id']}"), 10)     # the line may trail READY=1
    last = journal_runs(host)[-1]
    assert last["run_id"] == j["run_id"] and last["state"] == "done" and last["resumed"] == 1
    assert kernel_of(host).modules()["nvidia"].version == NEW
    assert d2.stop()[0] == 0
