"""Host trees with fake packages for the package crash tests, and a runner for one package
operation in a fresh process under the fault injector (tests/faults/sitecustomize.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, require_binary

REL = "6.1.0-47-cloud-amd64"
FAULTS = REPO / "tests" / "faults"
PKGOP = REPO / "tests" / "packages" / "pkgop.py"
STATE = "var/lib/driverd/packages"


@pytest.fixture(autouse=True)
def _kmod(kmod_tools):
    return kmod_tools


@pytest.fixture(scope="session")
def pk(tmp_path_factory):
    """Two fake packages for the same kernel: A (535) and B (550)."""
    from driverd.sim.fakepkg import make_fake_package
    d = tmp_path_factory.mktemp("pkgs")
    return {"A": make_fake_package(d, "535.261.03", REL), "B": make_fake_package(d, "550.127.05", REL)}


@pytest.fixture(scope="session")
def templates(tmp_path_factory, pk):
    """Host trees, written once and copied per test: `a` has A installed (and kept), `a_unkept` the
    same with an empty kept store (as an older driverd left it), `b` has A then B installed."""
    from driverd.install.modules import install
    from driverd.runner import Runner
    from driverd.sim.hosttree import HostSpec, write_host
    base = tmp_path_factory.mktemp("templates")
    a = write_host(base / "a", HostSpec(release=REL))
    install(a, pk["A"].path, Runner())
    a_unkept = base / "a_unkept"
    shutil.copytree(a, a_unkept, symlinks=True)
    shutil.rmtree(a_unkept / STATE / "kept")
    b = base / "b"
    shutil.copytree(a, b, symlinks=True)
    install(b, pk["B"].path, Runner())
    return {"a": a, "a_unkept": a_unkept, "b": b}


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def pkgop(root: Path, *args: str, faults: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """tests/packages/pkgop.py in a new process, with the fault injector first on its path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULTS_", "DRIVERD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), str(REPO)])
    env.update(faults or {})
    return subprocess.run([sys.executable, str(PKGOP), str(root), *args], capture_output=True, text=True, env=env,
                          timeout=120)


class Forks:
    """A pool of `pkgop.py --serve` fork servers: each operation runs in a new (forked) process under
    the armed fault injector, without Python's start-up and imports each time."""

    def __init__(self, n: int, log: Path) -> None:
        import queue
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAULTS_", "DRIVERD_"))}
        env.update(PYTHONPATH=os.pathsep.join([str(FAULTS), str(REPO)]), FAULTS_ARMED="1")
        self.log = open(log, "a")
        self.procs = [subprocess.Popen([sys.executable, str(PKGOP), "--serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)
                      for _ in range(n)]
        self.free: queue.Queue = queue.Queue()
        for p in self.procs:
            self.free.put(p)

    def __call__(self, root: Path, *args: str, faults: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        p = self.free.get()
        try:
            p.stdin.write(json.dumps({"argv": [str(root), *args], "env": faults or {}}) + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            assert line, f"fork server died (see {self.log.name})"
            rep = json.loads(line)
        finally:
            self.free.put(p)
        return subprocess.CompletedProcess(args, rep["returncode"], rep["stdout"], "")

    def close(self) -> None:
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="session")
def forks(tmp_path_factory):
    f = Forks(max(2, min(8, (os.cpu_count() or 2) * 2)), tmp_path_factory.mktemp("forks") / "stderr.log")
    yield f
    f.close()


def result(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root with its content digest (symlinks by target)."""
    import hashlib
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in fns + dns:
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel + "/"] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def show_depends(root: Path) -> list[str]:
    mp = require_binary("modprobe", "/usr/sbin/modprobe", "/sbin/modprobe")
    r = subprocess.run([mp, "-d", str(root), "-S", REL, "--show-depends", "nvidia"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("insmod ")]


def leftovers(root: Path) -> list[str]:
    """Staging/holding directories anywhere driverd stages or holds trees."""
    out = []
    for d in (root / "lib/modules" / REL / "updates", root / "lib/firmware/nvidia", root / STATE,
              root / STATE / "kept", root / STATE / "previous"):
        if d.is_dir():
            out += [str(d / n) for n in os.listdir(d) if n.startswith(".driverd-")]
    updates = root / "lib/modules" / REL / "updates"
    out += [str(updates / n) for n in os.listdir(updates) if n != "driverd"] if updates.is_dir() else []
    return out


def problems(root: Path, ref, *, kept: tuple = ()) -> list[str]:
    """What is wrong with `root` for 'package ref is installed, complete, and nothing is pending'."""
    from driverd.install import modules as inst
    from driverd.install import kept as kp
    bad = []
    if not inst.is_installed(root, REL, ref.sha256):
        bad.append(f"is_installed({ref.sha256[:12]}) is false (installed: {inst.installed_sha256(root, REL)})")
    mdir = root / "lib/modules" / REL / "updates/driverd"
    m = kp.tree_manifest(mdir)
    if m is None or m.driver_version != ref.manifest.driver_version:
        bad.append(f"installed manifest is {m and m.driver_version}")
    for f in ref.manifest.module_files:
        p = mdir / Path(f.path).name
        if not p.is_file() or _sha(p) != f.sha256:
            bad.append(f"{p.name} differs from the package")
    fw = root / "lib/firmware/nvidia" / ref.manifest.driver_version
    if not kp.firmware_same(fw, ref.manifest):
        bad.append(f"firmware {fw} differs from the package")
    if (root / STATE / f"pending-{REL}.json").exists():
        bad.append("a switch is pending")
    dep = show_depends(root)
    if dep != [str(mdir / "nvidia.ko")]:
        bad.append(f"modprobe resolves nvidia to {dep}")
    bad += [f"leftover {x}" for x in leftovers(root)]
    for k in kept:
        if kp.lookup(inst._root(root), "/var/lib/driverd", k.sha256) is None:
            bad.append(f"{k.manifest.driver_version} is not kept")
    return bad


def _sha(p: Path) -> str:
    import hashlib
    return hashlib.sha256(p.read_bytes()).hexdigest()
