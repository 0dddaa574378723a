"""systemd restarts never deadlock at boot: only an active unit is restarted, with
`systemctl try-restart --no-block`, and the wait for it to come back is bounded. Driven through a fake
`systemctl` on PATH (the Runner finds commands with shutil.which)."""
from __future__ import annotations

import socket
import time

import pytest

from driverd.root import Root
from driverd.runner import Runner
from driverd.runtime.restart import restart, systemd_decision

FAKE = r"""#!/bin/sh
# fake systemctl: state in $FAKE_DIR, every call logged
d="$FAKE_DIR"
echo "$*" >> "$d/log"
state=$(cat "$d/state")
case "$1" in
  is-active)
    [ -n "$FAKE_BROKEN" ] && { echo "System has not been booted with systemd as init system (PID 1). Can't operate." >&2; exit 1; }
    echo "$state"; [ "$state" = active ] && exit 0; exit 3 ;;
  show)
    echo "ActiveState=$state"; echo "InvocationID=$(cat "$d/inv")"; exit 0 ;;
  try-restart)
    case "$FAKE_RESTART" in
      ok) echo inv2 > "$d/inv"; echo active > "$d/state" ;;
      fail) echo inv2 > "$d/inv"; echo failed > "$d/state" ;;
      queued) : ;;   # the job waits for a unit ordered before it (driverd.service at boot): never runs
    esac
    exit 0 ;;
  restart) sleep 30; exit 0 ;;   # a blocking restart at boot: what must never be run
esac
exit 1
"""


@pytest.fixture
def fake_systemctl(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "systemctl"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    state = tmp_path / "fake"
    state.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(state))

    def _set(unit_state: str, restart_behaviour: str = "ok", broken: bool = False):
        (state / "state").write_text(unit_state + "\n")
        (state / "inv").write_text("inv1\n")
        (state / "log").write_text("")
        monkeypatch.setenv("FAKE_RESTART", restart_behaviour)
        if broken:
            monkeypatch.setenv("FAKE_BROKEN", "1")
        return lambda: (state / "log").read_text().splitlines()
    return _set


@pytest.fixture
def listening(tmp_path):
    path = str(tmp_path / "c.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    yield path
    srv.close()


@pytest.mark.parametrize("state,restarts", [
    ("active", True), ("reloading", True), ("inactive", False), ("activating", False), ("deactivating", False),
    ("failed", False), ("unknown", False), ("", False)])
def test_decision(state, restarts):
    do, why = systemd_decision("containerd", "containerd", state)
    assert do is restarts
    if not restarts:
        assert "not restarted" in why and "reads the new configuration" in why


@pytest.mark.parametrize("state", ["inactive", "activating", "failed", "unknown"])
def test_not_active_is_not_restarted(fake_systemctl, state):
    log = fake_systemctl(state)
    start = time.monotonic()
    ok, what, waited = restart(Root("/"), "containerd", "containerd", None, "systemd", Runner(), 5)
    assert time.monotonic() - start < 3
    assert not ok and waited is None and "not restarted" in what and "reads the new configuration" in what
    assert log() == ["is-active containerd"]


def test_active_is_try_restarted_without_blocking(fake_systemctl, listening):
    log = fake_systemctl("active", "ok")
    ok, what, waited = restart(Root("/"), "containerd", "containerd", listening, "systemd", Runner(), 5)
    assert ok and waited is not None and "answered after" in what
    assert "ran systemctl try-restart --no-block containerd" in what
    calls = log()
    assert calls[0] == "is-active containerd" and "try-restart --no-block containerd" in calls
    assert not any(c.split()[0] == "restart" for c in calls)


def test_queued_restart_is_a_bounded_note_not_a_hang(fake_systemctl, listening):
    # the boot case: the restart job waits for driverd.service itself; driverd must not wait forever
    fake_systemctl("active", "queued")
    start = time.monotonic()
    ok, what, waited = restart(Root("/"), "containerd", "containerd", listening, "systemd", Runner(), 1)
    assert time.monotonic() - start < 5
    assert ok and waited is None and "was not running again within 1s" in what


def test_socket_that_never_answers_is_a_note(fake_systemctl, tmp_path):
    fake_systemctl("active", "ok")
    start = time.monotonic()
    ok, what, waited = restart(Root("/"), "containerd", "containerd", str(tmp_path / "never.sock"), "systemd",
                               Runner(), 1)
    assert time.monotonic() - start < 5
    assert ok and waited is None and "did not answer within 1s" in what


def test_failed_restart_is_reported(fake_systemctl, listening):
    fake_systemctl("active", "fail")
    ok, what, _ = restart(Root("/"), "containerd", "containerd", listening, "systemd", Runner(), 5)
    assert "failed to start again" in what and "journalctl -u containerd" in what


def test_systemd_that_cannot_be_asked_is_reported(fake_systemctl):
    log = fake_systemctl("active", broken=True)
    ok, what, _ = restart(Root("/"), "crio", "crio", None, "systemd", Runner(), 5)
    assert not ok and "is-active crio failed" in what and "booted with systemd" in what
    assert log() == ["is-active crio"]


def test_dry_run_records_only_the_non_blocking_restart(fake_systemctl):
    log = fake_systemctl("active")
    r = Runner(dry_run=True)
    ok, what, _ = restart(Root("/"), "docker", "docker", None, "systemd", r, 5)
    assert not ok and what == "would run: systemctl try-restart --no-block docker (only if docker is active)"
    assert [h.argv for h in r.history] == [("systemctl", "try-restart", "--no-block", "docker")]
    assert log() == []
