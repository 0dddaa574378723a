"""Helpers for runtime tests: host trees built from fixtures, and a private containerd (1.6 or 2.1)
run against the configuration driverd produced — never this machine's /etc/containerd or daemon."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import CI_PREFIX, FIXTURES, require_binary

RT = FIXTURES / "runtime"
C16 = ("/usr/bin/containerd", "/usr/bin/ctr")
C21 = (str(CI_PREFIX / "containerd2/usr/bin/containerd"), str(CI_PREFIX / "containerd2/usr/bin/ctr"))


def fixture_text(name: str, tmp: str) -> str:
    return (RT / name if "/" in name else RT / "containerd" / name).read_text().replace("{TMP}", tmp)


def make_host(host: Path, files: dict[str, str], versions: dict[str, str] | None = None) -> Path:
    """A host tree: `files` maps host paths to content; binaries named in `versions` exist (empty)."""
    for hp, text in files.items():
        p = host / hp.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for binary in versions or {}:
        p = host / binary.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch(mode=0o755)
    if versions:
        v = host / "var/lib/driverd/capture/versions.json"
        v.parent.mkdir(parents=True, exist_ok=True)
        v.write_text(json.dumps(versions))
    return host


def install_binary(host: Path, path: str = "/usr/bin/nvidia-container-runtime", mode: int = 0o755) -> None:
    """A (script) binary at a host path, with `mode`."""
    p = host / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"#!/bin/sh\n")
    os.chmod(p, mode)


def gpu_host(host: Path, files: dict[str, str], versions: dict[str, str]) -> Path:
    """A simulated host with one H100 (so `plan` plans) plus runtime files and binaries (make_host)."""
    from driverd.sim.hosttree import HostSpec, h100, write_host
    return make_host(write_host(host, HostSpec(pci=[h100("0000:1b:00.0")])), files, versions)


def snapshot(host: Path, under: str = "etc") -> dict[str, bytes]:
    base = host / under
    return {str(p.relative_to(host)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


class PrivateContainerd:
    """containerd in its own mount namespace: <host>/etc/containerd is bind-mounted on /etc/containerd
    (so absolute imports resolve inside the test tree); root, state and socket live in `state`."""

    def __init__(self, binary: str, ctr: str, etc_dir: Path, state: str) -> None:
        self.binary, self.ctr, self.etc_dir, self.state = binary, ctr, etc_dir, state
        self.sock = f"{state}/containerd.sock"

    def _ns(self, *args: str) -> list[str]:
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/containerd && exec "$@"', str(self.etc_dir), self.binary, *args]

    def dump(self, config: str = "/etc/containerd/config.toml") -> dict:
        res = subprocess.run(self._ns("--config", config, "config", "dump"), capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"config dump failed: {res.stderr[-2000:]}"
        return tomllib.loads(res.stdout)

    def plugins(self, config: str = "/etc/containerd/config.toml", wait_s: float = 20) -> tuple[dict, str]:
        """Start containerd, return ({'<type> <id>': status} for CRI plugins, log); always stop it."""
        log = Path(self.state) / "containerd.log"
        with open(log, "w") as lf:
            proc = subprocess.Popen(self._ns("--config", config), stdout=lf, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + wait_s
            while not os.path.exists(self.sock) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.05)
            assert os.path.exists(self.sock), f"containerd did not open its socket: {log.read_text()[-3000:]}"
            out = ""
            while time.monotonic() < deadline:   # the socket can appear before every plugin is in
                res = subprocess.run([self.ctr, "--address", self.sock, "plugins", "ls"], capture_output=True,
                                     text=True, timeout=20)
                out = res.stdout
                if " cri " in out:
                    break
                time.sleep(0.1)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        status = {}
        for line in out.splitlines()[1:]:
            cols = line.split()
            if len(cols) >= 3 and ("cri" in cols[0] or cols[1] == "cri"):
                status[f"{cols[0]} {cols[1]}"] = cols[-1]
        return status, log.read_text()


@pytest.fixture
def containerd_env(tmp_path):
    """Factory: (version '1.6'|'2.1') -> (PrivateContainerd, host root, state dir string)."""
    made = []

    def _make(version: str, host: Path | None = None):
        binary, ctr = C16 if version == "1.6" else C21
        require_binary("containerd" if version == "1.6" else binary, binary)
        require_binary(ctr, ctr)
        require_binary("unshare")
        if not os.path.isdir("/etc/containerd") or os.geteuid() != 0:
            pytest.skip("needs root and an /etc/containerd mount point for the private namespace")
        state = tempfile.mkdtemp(prefix="drd", dir="/tmp")   # short: unix socket paths are limited
        made.append(state)
        host = host or tmp_path / "host"
        (host / "etc/containerd").mkdir(parents=True, exist_ok=True)
        return PrivateContainerd(binary, ctr, host / "etc/containerd", state), host, state

    yield _make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def runtimes_of(dump: dict, version: int) -> dict:
    plugin = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}[version]
    return dump["plugins"][plugin]["containerd"]["runtimes"]


PEER = RT / "peer"


def peer_text(name: str, tmp: str) -> str:
    """A fixture recreating what NVIDIA's tooling leaves behind (tests/fixtures/runtime/peer)."""
    return (PEER / name).read_text().replace("{TMP}", tmp)


def _balanced(s: str, i: int) -> int:
    """Index just past the bracket group that opens at s[i] ('{' or '[')."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] in "{[":
            depth += 1
        elif s[j] in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError("unbalanced")


def cri_effective(log: str) -> dict:
    """What containerd 1.6's CRI plugin really runs with, from its startup line
    `Start cri plugin with config {...}` (logged after its own validation, so the deprecated
    default_runtime table has already become runtime "default" and the default): {"default": name,
    "runtimes": {name: "<the Go %+v text of that runtime>"}}. `config dump` cannot show this: it
    prints the configuration as read, before the plugin applies those rules."""
    line = next(ln for ln in log.splitlines() if "Start cri plugin with config" in ln)
    default = re.search(r"ContainerdConfig:\{[^{]*?DefaultRuntimeName:([^\s}]+)", line).group(1)
    start = line.index("Runtimes:map[") + len("Runtimes:map")
    body = line[start + 1:_balanced(line, start) - 1]
    runtimes, i = {}, 0
    while i < len(body):
        colon = body.index(":", i)
        name = body[i:colon].strip()
        end = _balanced(body, colon + 1)
        runtimes[name] = body[colon + 1:end]
        i = end
    return {"default": default, "runtimes": runtimes}
