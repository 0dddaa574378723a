"""The host lock: one transaction at a time, the loser names the holder or waits, a dead holder
releases it, readers take none."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from driverd.apply.lock import HostLock, LockHeld
from driverd.root import Root
from tests.apply.conftest import drv, journal

STATE = "/var/lib/driverd"


def test_second_mutator_exits_3_naming_the_holder(loaded_host):
    lock = HostLock(Root(loaded_host), STATE, "reload --package x.tar.zst").acquire()
    try:
        before = journal(loaded_host)
        r = drv(loaded_host, "unload")
        assert r.returncode == 3, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert f"pid {os.getpid()}" in line and "reload --package x.tar.zst" in line and "--wait" in line
        assert journal(loaded_host) == before                   # the loser wrote nothing
        st = drv(loaded_host, "status", "--json")               # a reader is not blocked
        assert st.returncode == 0 and json.loads(st.stdout)["lock_holder"]["pid"] == os.getpid()
        r = drv(loaded_host, "install", "/nonexistent.tar.zst")  # bad usage is still bad usage first
        assert r.returncode == 2
    finally:
        lock.release()
    assert drv(loaded_host, "unload").returncode == 0


def test_wait_takes_the_lock_when_the_holder_finishes(loaded_host):
    lock = HostLock(Root(loaded_host), STATE, "apply").acquire()
    threading.Timer(1.0, lock.release).start()
    t = time.monotonic()
    r = drv(loaded_host, "unload", "--wait", "30")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t >= 1.0
    r = drv(loaded_host, "load", "--wait", "0.2")               # free now: no wait at all
    assert r.returncode == 0, r.stderr


def test_wait_that_runs_out_says_how_long_it_waited(loaded_host):
    with HostLock(Root(loaded_host), STATE, "apply").acquire():
        r = drv(loaded_host, "unload", "--wait", "0.5")
    assert r.returncode == 3 and "after waiting 0.5s" in r.stderr and "(apply)" in r.stderr


def test_a_holder_killed_with_sigkill_releases_the_lock(loaded_host):
    code = ("import sys, time; from driverd.root import Root; from driverd.apply.lock import HostLock; "
            f"HostLock(Root({str(loaded_host)!r}), {STATE!r}, 'apply').acquire(); print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    try:
        r = drv(loaded_host, "unload")
        assert r.returncode == 3 and f"pid {p.pid} (apply)" in r.stderr
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    r = drv(loaded_host, "unload")
    assert r.returncode == 0, r.stderr


def test_in_process_lock_is_exclusive_and_names_holder(tmp_path):
    root = Root(tmp_path)
    a = HostLock(root, STATE, "reload").acquire()
    try:
        try:
            HostLock(root, STATE, "rollback").acquire(wait_s=0)
            raise AssertionError("second lock acquired")
        except LockHeld as e:
            assert e.exit_code == 3 and "reload" in e.message and e.details["holder"]["pid"] == os.getpid()
    finally:
        a.release()
    HostLock(root, STATE, "rollback").acquire().release()
