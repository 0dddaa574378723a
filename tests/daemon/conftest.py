"""`driverd daemon` / `driverd container-entrypoint` as real subprocesses on simulated hosts: the
notifications they send to a unix datagram socket bound here (as systemd's would be), their HTTP
endpoints on loopback, their stderr."""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.apply.conftest import node  # noqa: F401  (fixture)
from tests.kmod.conftest import host, kernel_of, packages  # noqa: F401  (fixtures)
from tests.conftest import driverd_env

OLD, NEW = "535.261.03", "550.127.05"


def write_config(root, version: str, repo, extra: str = "", daemon: str = "", check_s: int = 1) -> None:
    """The host's config.toml: driver `version` from the file:// repository `repo`, runtimes never
    restarted, a config check every `check_s` seconds and quick retries; `daemon`: more [daemon] keys,
    `extra`: more sections."""
    p = Path(root) / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    text = (f'[driver]\nversion = "{version}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
            f'[runtime]\nrestart = "none"\n[daemon]\nconfig_check_s = {check_s}\nretry_min_s = 1\n'
            f'retry_max_s = 2\n{daemon}{extra}')
    tmp = p.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, p)                 # a new inode: what editors and ConfigMap updates do


class Daemon:
    """One driverd daemon process with a notify socket and its stderr collected line by line."""

    def __init__(self, root, command: str = "daemon", *, env: dict | None = None, root_arg: bool = True,
                 watchdog_usec: int | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="drvd-"))     # short: AF_UNIX paths are limited to 107 bytes
        self.notify_path = str(self.dir / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.notify_path)
        self.messages: queue.Queue = queue.Queue()
        self.all_messages: list[str] = []
        self.lines: list[str] = []
        self._line_event = threading.Condition()
        self._eof = False
        e = driverd_env(drop=("DRIVERD_", "FAULTS_", "NOTIFY_", "WATCHDOG_"))
        e["NOTIFY_SOCKET"] = self.notify_path
        if watchdog_usec:
            e["WATCHDOG_USEC"] = str(watchdog_usec)
        e.update(env or {})
        args = [sys.executable, "-m", "driverd", command, "--listen", "127.0.0.1:0"]
        if root_arg:
            args += ["--root", str(root)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=e)
        threading.Thread(target=self._read_stderr, daemon=True).start()
        threading.Thread(target=self._read_notify, daemon=True).start()
        m = self.wait_log(r"listening on 127\.0\.0\.1:(\d+)", 30)
        self.port = int(m.group(1))

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            with self._line_event:
                self.lines.append(line.rstrip("\n"))
                self._line_event.notify_all()
        with self._line_event:
            self._eof = True
            self._line_event.notify_all()

    def _read_notify(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            msg = data.decode()
            self.all_messages.append(msg)
            self.messages.put((time.monotonic(), msg))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_log(self, pattern: str, timeout: float = 30, start: int = 0) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._line_event:
            while True:
                for line in self.lines[start:]:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(f"no stderr line matching {pattern!r} in {timeout}s "
                                         f"(exit {self.proc.poll()}):\n{self.log}")
                self._line_event.wait(min(left, 0.5))

    def wait_notify(self, needle: str, timeout: float = 30) -> tuple[float, str]:
        """The next notification containing `needle` (earlier ones are consumed)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no notification with {needle!r} in {timeout}s; got {self.all_messages}\n"
                                     f"{self.log}")
            try:
                at, msg = self.messages.get(timeout=left)
            except queue.Empty:
                continue
            if needle in msg:
                return at, msg

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str, **labels) -> float | None:
        _, text = self.get("/metrics")
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            n, _, rest = key.partition("{")
            got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if n == name and (not labels or got == want):
                return float(value)
        return None

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 15) -> tuple[int, float]:
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, time.monotonic() - t

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def passes_later(d) -> None:
    """Return once the daemon `d` has run several reconcile passes after now (each logs reconcile or
    converged; config_check_s is 1 s in these tests): what it keeps must still be there then."""
    mark = len(d.lines)
    d.wait_log(r"reconcile|converged", 20, start=mark)
    time.sleep(3)


@pytest.fixture
def daemons():
    """Start daemons with daemons(root, ...); every one is killed at the end of the test."""
    started: list[Daemon] = []

    def start(root, command: str = "daemon", **kw) -> Daemon:
        d = Daemon(root, command, **kw)
        started.append(d)
        return d
    yield start
    for d in started:
        d.close()


def journal_runs(root) -> list[dict]:
    """Every run, archived ones first, then the current journal."""
    import json
    base = Path(root) / "var/lib/driverd"
    runs = [json.loads(p.read_text()) for p in sorted((base / "journal.d").glob("*.json"))] \
        if (base / "journal.d").is_dir() else []
    if (base / "journal.json").exists():
        runs.append(json.loads((base / "journal.json").read_text()))
    return runs


def cluster_node(fleet, node: str, extra: str = "", *, coordinator: bool = True) -> Path:
    """A simulated node's host tree configured for cluster mode as deploy/ does it: the node-bound token's
    kubeconfig at /etc/driverd/kubeconfig, [cluster] naming the node, its own side of rollouts only
    (coordinate = false: deploy/'s coordinator of its own identity coordinates: started here unless
    `coordinator` is False, where the fleet gives identities), and daemon timers of a second (`extra`:
    more [daemon] keys). Returns the node's root."""
    root = fleet.nodes[node].root
    shutil.copy(fleet.node_kubeconfig(node), root / "etc/driverd/kubeconfig")
    own = fleet.coordinator_mode == "own"
    p = root / "etc/driverd/config.toml"
    p.write_text(p.read_text() + f'[cluster]\nkubeconfig = "/etc/driverd/kubeconfig"\nnode_name = "{node}"\n'
                 + ("coordinate = false\n" if own else "") +
                 f'[daemon]\ninterval_s = 1\nretry_min_s = 1\nretry_max_s = 1\n{extra}')
    if own and coordinator and not fleet.coordinators:
        fleet.start_coordinator()
    return root
