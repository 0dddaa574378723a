"""issue 32 item 4: a host-mode daemon whose wanted driver cannot be had (no repository holds it, its
upgrade failed and rolled back) while the previous driver runs, validated and workload-ready, is
ready - degraded: READY=1 (systemd no longer holds containerd and kubelet back for TimeoutStartSec),
/readyz 200 saying so, driverd_degraded 1, `driverd status` naming the wanted version and why it could
not be had - and it keeps trying with backoff. A host with no working driver still never sends READY=1."""
from __future__ import annotations

import json

from driverd.sim.scenario import RELEASE
from tests.apply.conftest import drv
from tests.daemon.conftest import NEW, OLD, kernel_of, write_config

MISSING = "570.195.03"          # no repository of these tests holds it and no source is configured


def _converged_on_old(host, repo) -> None:
    write_config(host, OLD, repo)
    r = drv(host, "apply")
    assert r.returncode == 0, r.stderr
    assert kernel_of(host).modules()["nvidia"].version == OLD


def test_a_wanted_driver_that_cannot_be_fetched_leaves_the_node_ready_and_degraded(host, packages, daemons):
    repo = packages["old"].parent
    _converged_on_old(host, repo)
    write_config(host, MISSING, repo)            # what the daemon finds at boot: another version wanted
    d = daemons(host)
    _, ready = d.wait_notify("READY=1", 60)
    assert "STATUS=degraded: " in ready and f"driver {OLD} (open) loaded and validated" in ready, ready
    assert MISSING in ready, ready
    code, body = d.get("/readyz")
    assert code == 200 and body.startswith("ready: degraded: ") and MISSING in body and OLD in body, body
    assert body.count("\n") == 1
    assert d.metric("driverd_degraded") == 1 and d.metric("driverd_ready") == 1
    assert d.metric("driverd_driver_info", version=OLD, flavor="open", kernel=RELEASE) == 1
    assert kernel_of(host).modules()["nvidia"].version == OLD           # the running driver is untouched

    # driverd status: the daemon is ready, degraded, wanting MISSING, and why not
    s = json.loads(drv(host, "status", "--json").stdout)
    dg = s["daemon"]["last_reconcile"]["degraded"]
    assert s["daemon"]["ready"] is True and dg["wanted"] == MISSING and dg["running"] == {"version": OLD,
                                                                                       "flavor": "open"}
    assert dg["why"] and s["wanted"]["in_sync"] is False
    text = drv(host, "status").stdout
    assert f"ready, DEGRADED: running {OLD} (open), validated; wanted {MISSING}: " in text, text

    # it keeps trying (with backoff) and stays ready while it does
    n = len(d.lines)
    d.wait_log(r"not converged: .*retrying in", 30, start=n)
    assert d.get("/readyz")[0] == 200
    assert sum("READY=1" in m for m in d.all_messages) == 1

    # the wanted version becomes available (here: a repository that holds it): converged, no longer degraded
    write_config(host, NEW, repo)
    d.wait_log(r"converged: driver 550\.127\.05 \(open\)", 60)
    _, st = d.wait_notify("STATUS=converged", 10)
    code, body = d.get("/readyz")
    assert code == 200 and body.startswith("ready: driver 550.127.05") and "degraded" not in body
    assert d.metric("driverd_degraded") == 0
    assert d.stop()[0] == 0


def test_a_host_with_no_working_driver_is_never_ready(host, packages, daemons):
    """The package of OLD is installed but nothing is loaded (a boot where nothing loaded it) and the wanted
    version cannot be fetched: no driver works, so no READY=1, /readyz 503, not degraded."""
    write_config(host, MISSING, packages["old"].parent)
    d = daemons(host)
    d.wait_log(r"not converged: ", 60)
    d.wait_log(r"not converged: ", 30, start=len(d.lines))          # a retry too
    assert not any("READY=1" in m for m in d.all_messages), d.all_messages
    code, body = d.get("/readyz")
    # the file:// repository's index is read by the plan: blocked, naming the package nobody lists (issue 48)
    assert code == 503 and body.startswith("not ready: blocked: ") and f"no repository lists driverd-{MISSING}" in body, body
    assert d.metric("driverd_degraded") == 0 and d.metric("driverd_ready") == 0
    assert not kernel_of(host).is_loaded("nvidia")
    assert d.stop()[0] == 0


def test_readiness_of_a_degraded_pass_follows_the_driver_it_validated():
    from driverd.apply.reconcile import Result
    from driverd.daemon.health import Health
    now = {"v": {"version": OLD, "flavor": "open"}}
    h = Health(lambda: now["v"])
    h.update(Result("failed", "apply failed at fetch-package: x", "rolled-back"))
    assert h.readiness() == (False, "failed: apply failed at fetch-package: x")       # no driver validated
    h.update(Result("failed", "apply failed at fetch-package: x", "rolled-back",
                    degraded={"running": {"version": OLD, "flavor": "open"}, "wanted": MISSING,
                              "why": "failed: apply failed at fetch-package: x"}))
    want = (f"degraded: driver {OLD} (open) loaded and validated, not the wanted {MISSING} (retrying): "
            "failed: apply failed at fetch-package: x")
    assert h.readiness() == (True, want) and h.status_line() == want
    h.begin("reconciling the host with the configuration")         # a retry runs: still ready on OLD
    assert h.readiness()[0] is True and h.status_line().startswith("reconciling: ")
    now["v"] = None                                                  # unloaded by hand: not ready at once
    assert h.readiness() == (False, f"the NVIDIA driver is not loaded (the last reconcile validated {OLD})")
    now["v"] = {"version": OLD, "flavor": "open"}
    h.update(Result("converged", f"driver {NEW} (open) loaded and validated", loaded={"version": NEW, "flavor": "open"}))
    assert h.readiness()[0] is False                                 # the kernel reports OLD, NEW was validated
    now["v"] = {"version": NEW, "flavor": "open"}
    assert h.readiness() == (True, f"driver {NEW} (open) loaded and validated; last reconcile converged")
