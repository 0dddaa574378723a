"""Restart modes and the bounded wait for a runtime's socket."""
from __future__ import annotations

import socket
import threading
import time

from driverd.root import Root
from driverd.runner import Runner
from driverd.runtime.restart import restart, wait_socket


def test_wait_socket_returns_when_it_answers(tmp_path):
    path = str(tmp_path / "rt.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def listen_later():
        time.sleep(0.3)
        srv.bind(path)
        srv.listen(1)
    t = threading.Thread(target=listen_later)
    t.start()
    try:
        waited = wait_socket(path, 5)
        assert waited is not None and 0.2 <= waited < 5
    finally:
        t.join()
        srv.close()


def test_wait_socket_is_bounded(tmp_path):
    start = time.monotonic()
    assert wait_socket(str(tmp_path / "never.sock"), 0.5) is None
    assert time.monotonic() - start < 3


def test_signal_is_refused_for_containerd_and_none_only_reports(tmp_path):
    r = Runner()
    ok, what, _ = restart(Root(tmp_path), "containerd", "containerd", None, "signal", r)
    assert not ok and "does not reload" in what
    ok, what, _ = restart(Root(tmp_path), "docker", "docker", None, "none", r)
    assert not ok and "restart docker" in what and r.history == []


def test_systemd_failure_is_reported_not_raised(tmp_path):
    # chroot into a tree without systemctl: the failure is reported in the change report
    ok, what, _ = restart(Root(tmp_path), "crio", "crio", "/var/run/crio/crio.sock", "systemd", Runner(), 2)
    assert not ok and "failed" in what
