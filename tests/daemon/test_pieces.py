"""The daemon's parts on their own: sd_notify on a real (abstract) socket, parameter comparison,
the backoff, --listen parsing, the desired-state fingerprint, readiness."""
from __future__ import annotations

import os
import socket

import pytest

from driverd.daemon.backoff import Backoff
from driverd.apply.drift import parameter_drift, same_value
from driverd.driver.state import parse_nvidia_params
from driverd.daemon.endpoints import parse_listen
from driverd.apply.fingerprint import fingerprint
from driverd.daemon.health import Health
from driverd.daemon.notify import Notifier
from driverd.errors import UsageError


def test_notify_on_an_abstract_socket_and_the_watchdog_period():
    name = f"driverd-test-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind("\0" + name)
    srv.settimeout(5)
    n = Notifier({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "4000000"})
    assert n.enabled and n.watchdog_s == 2.0
    assert n.ready("converged: driver 535.261.03 (open)")
    msg = srv.recv(4096).decode().split("\n")
    assert msg[0] == "READY=1" and msg[1] == "STATUS=converged: driver 535.261.03 (open)"
    assert n.status("line one\nline two") and srv.recv(4096) == b"STATUS=line one line two"
    assert n.watchdog() and srv.recv(4096) == b"WATCHDOG=1"
    assert n.stopping() and srv.recv(4096).startswith(b"STOPPING=1\n")
    srv.close()
    assert not n.send("STATUS=gone")                 # the manager went away: no exception
    n.close()


def test_notify_without_a_socket_or_for_another_pid_does_nothing():
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and n.watchdog_s is None
    other = Notifier({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.watchdog_s is None


@pytest.mark.parametrize("running,wanted,same", [
    ("Y", "1", True), ("N", "false", True), ("18", "0x12", True), ("0", "0", True), ('"abc"', "abc", True),
    ("Y", "0", False), ("18", "19", False), ("abc", "abd", False)])
def test_parameter_values_compare_as_the_kernel_prints_them(running, wanted, same):
    assert same_value(running, wanted) is same


def test_parameter_drift_uses_the_best_evidence_and_never_guesses():
    running = {"nvidia": {"NVreg_A": "1"}, "nvidia_drm": {"modeset": "Y"}}
    assert parameter_drift(running, {"nvidia": {"NVreg_A": "1"}, "nvidia_drm": {"modeset": "1"}}) == []
    assert parameter_drift(running, {"nvidia": {"NVreg_A": "2"}}) == ["nvidia.NVreg_A: running '1', configured '2'"]
    # not visible anywhere and nothing recorded: no evidence, no drift
    assert parameter_drift(running, {"nvidia": {"NVreg_B": "5"}}) == []
    # recorded with the last converge of this driver: added, changed and removed parameters show
    assert parameter_drift(running, {"nvidia": {"NVreg_B": "5"}}, {"nvidia": {}}) == \
        ["nvidia.NVreg_B: loaded with '(its default)', configured '5'"]
    assert parameter_drift(running, {"nvidia": {"NVreg_B": "5"}}, {"nvidia": {"NVreg_B": "5"}}) == []
    assert parameter_drift(running, {}, {"nvidia": {"NVreg_B": "5"}}) == \
        ["nvidia.NVreg_B: loaded with '5', no longer configured"]
    assert parameter_drift({}, {"nvidia": {"NVreg_B": "5"}}, {"nvidia": {}}) == []      # not loaded
    assert parse_nvidia_params('EnableGpuFirmware: 18\nRegistryDwords: ""\n') == \
        {"NVreg_EnableGpuFirmware": "18", "NVreg_RegistryDwords": ""}


def test_backoff_doubles_to_the_cap_and_resets():
    b = Backoff(10, 60)
    assert [b.next() for _ in range(5)] == [10, 20, 40, 60, 60]
    b.reset()
    assert b.next() == 10


def test_listen_addresses():
    assert parse_listen("127.0.0.1:9477") == ("127.0.0.1", 9477)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9477") == ("0.0.0.0", 9477)
    for bad in ("9477", "host:port", "1.2.3.4:70000"):
        with pytest.raises(UsageError):
            parse_listen(bad)


def test_the_fingerprint_follows_the_desired_state_only(tmp_path):
    from driverd.config import load
    from driverd.root import Root
    cfg = load(Root(tmp_path), environ={})
    base = fingerprint(cfg, "6.1.0", "sha")
    assert fingerprint(cfg.with_overrides({"daemon.interval_s": 5, "packages.cache_max_mb": 1}), "6.1.0", "sha") == base
    assert fingerprint(cfg.with_overrides({"driver.version": "550.127.05"}), "6.1.0", "sha") != base
    assert fingerprint(cfg, "6.1.1", "sha") != base and fingerprint(cfg, "6.1.0", "other") != base


def test_readiness_needs_a_converge_and_the_same_driver_still_loaded():
    from driverd.apply.reconcile import Result
    now = {"v": {"version": "535.261.03", "flavor": "open"}}
    h = Health(lambda: now["v"])
    assert h.readiness() == (False, "starting: the first reconcile has not finished")
    h.update(Result("converged", "driver 535.261.03 (open) loaded and validated",
                    loaded={"version": "535.261.03", "flavor": "open"}))
    assert h.readiness()[0] is True
    now["v"] = None
    assert h.readiness() == (False, "the NVIDIA driver is not loaded (the last reconcile validated 535.261.03)")
    h.update(Result("blocked", "the plan is blocked: x", "blocked"))
    assert h.readiness() == (False, "blocked: the plan is blocked: x")


def test_metrics_exposition_parses_and_names_the_state_label_state():
    """The Prometheus text format, read back by prometheus_client's own parser: driverd_state has one series
    per state under the label `state` (issue 32: it was driverd_state{driverd_state=...}), 1 for the
    current one; no metric repeats its name as a label."""
    from prometheus_client.parser import text_string_to_metric_families

    from driverd.daemon.health import STATES
    from driverd.daemon.metrics import Metrics
    m = Metrics()
    m.set_state("blocked")
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    state = fams["driverd_state"]
    assert {s.labels["state"]: s.value for s in state.samples} == {s: (1.0 if s == "blocked" else 0.0) for s in STATES}
    assert all(set(s.labels) == {"state"} for s in state.samples)
    for f in fams.values():
        for s in f.samples:
            assert f.name not in s.labels and s.name not in s.labels, (f.name, s.labels)
    m.set_state("no-such-state")
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert [s.labels["state"] for s in fams["driverd_state"].samples if s.value == 1] == ["error"]
