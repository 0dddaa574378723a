"""`driverd daemon` on the layout of a real GPU host (captured from the device's H200: Ubuntu 24.04,
kernel 6.18 with signatures enforced and no module unloading, open 580.159.04 loaded as nvidia +
nvidia_uvm only, no /lib/modules, no package record), through the real kernel boundary: it is
converged as it is — READY, /readyz 200, nothing written to the host's configuration, exit 0 on
SIGTERM. Before this round the daemon failed validation (nvidia_modeset) and retried for ever."""
from __future__ import annotations

import hashlib
import re
from tests.daemon.conftest import write_config


def _etc(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted((root / "etc").rglob("*"))}


def test_daemon_converges_on_the_captured_h200_host(unpack_host, daemons, tmp_path):
    root = unpack_host("h200-ubuntu-fc-580-open.tar.gz")
    write_config(root, "580.159.04", tmp_path / "no-repo")      # the version that runs; auto flavour
    (root / "etc/driverd/config.toml").write_text((root / "etc/driverd/config.toml").read_text()
                                                  .replace('flavor = "open"', 'flavor = "auto"'))
    before = _etc(root)
    d = daemons(root, env={"DRIVERD_MODULES_KERNEL": "real"})
    _, msg = d.wait_notify("READY=1", 60)
    assert "converged" in msg and "nvidia, nvidia_uvm" in msg, msg
    code, body = d.get("/readyz")
    assert code == 200, body
    d.wait_log(re.escape("left to the host (owner unknown)"), 30)    # the log reader may lag READY=1
    assert "rolls back" not in d.log and "validation failed" not in d.log
    rc, _ = d.stop()
    assert rc == 0
    assert _etc(root) == before              # no blacklist, no module options written
    assert not (root / "etc/modprobe.d").exists()


def test_a_restarted_container_on_the_captured_host_takes_the_fast_path_with_the_driver_left_to_the_host(
        unpack_host, daemons, tmp_path):
    """Issue 47: on the live H200 hosts every restart of the driver container reconciled in full ("no fast
    path: no converged state is recorded") because a driver left to the host was never recorded. Now the
    converge is recorded with left_to, and the restart goes ready through the fast path: the same checks,
    the validation included, and no reconcile."""
    root = unpack_host("h200-ubuntu-fc-580-open.tar.gz")
    write_config(root, "580.159.04", tmp_path / "no-repo")
    env = {"DRIVERD_MODULES_KERNEL": "real", "DRIVERD_ROOT": str(root)}
    d = daemons(root, "container-entrypoint", env=env, root_arg=False)
    d.wait_notify("READY=1", 60)
    d.wait_log(re.escape("no fast path: no converged state is recorded"), 10)
    assert d.stop()[0] == 0
    import json
    rec = json.loads((root / "var/lib/driverd/daemon/converged.json").read_text())
    assert rec["left_to"] == "the host (owner unknown)" and rec["driver"]["version"] == "580.159.04", rec
    from driverd.driver.state import DriverState
    from driverd.root import Root
    assert DriverState(Root(root)).last_converged() is None         # never taken for a driver of driverd's
    d = daemons(root, "container-entrypoint", env=env, root_arg=False)
    _, msg = d.wait_notify("READY=1", 30)
    d.wait_log(re.escape("fast path: driver 580.159.04 (open, left to the host (owner unknown)) is loaded and valid"), 10)
    assert "converged" in msg
    assert d.stop()[0] == 0


def test_a_configured_version_the_host_driver_is_not_is_said_while_ready(unpack_host, daemons, tmp_path):
    """Issue 48: driver.version 570.195.03 on a host whose 580 driver is left to the host went READY saying
    only "converged: driver 580.159.04 ... workload-ready". It stays ready (the driver works), and the reason,
    /readyz, the metrics and `driverd status` say the configured version is not applied, and why."""
    root = unpack_host("h200-ubuntu-fc-580-open.tar.gz")
    write_config(root, "570.195.03", tmp_path / "no-repo")
    (root / "etc/driverd/config.toml").write_text((root / "etc/driverd/config.toml").read_text()
                                                  .replace('flavor = "open"', 'flavor = "auto"'))
    d = daemons(root, env={"DRIVERD_MODULES_KERNEL": "real"})
    _, msg = d.wait_notify("READY=1", 60)
    code, body = d.get("/readyz")
    said = "driver.version 570.195.03 is not applied: driver 580.159.04 is left to the host (owner unknown)"
    assert code == 200 and said in body, body
    assert d.metric("driverd_configured_version_applied") == 0
    assert d.stop()[0] == 0
    from tests.conftest import run_cli
    r = run_cli("status", "--root", str(root), "--kernel-backend", "real", env={"DRIVERD_CONFIG": str(root / "etc/driverd/config.toml")})
    assert f"NOT APPLIED: {said}" in r.stdout, r.stdout + r.stderr
