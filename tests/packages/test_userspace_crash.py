"""kill -9 after every durable effect of a user-space install and restore (driverd.install.userspace),
then a new process: the node ends on one complete user-space — the one asked for — with `current`, the
loader's configuration and cache, the PATH links and the finder agreeing, nothing pending and nothing left
over, and the replaced tree still there. The effects are counted by tests/faults' injector (renames, fsyncs,
links, unlinks, mkdirs, the real ldconfig) on the host tree only (FAULTS_UNDER)."""
from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from driverd.driver import files as driverfiles
from driverd.install import userspace as ui
from driverd.driver import userspace as dus
from driverd.build.userspace import build_from_run_dir
from driverd.root import Root
from tests.conftest import missing_component, require_binary
from tests.packages import usfake
from tests.packages.conftest import copy_tree, pkgop, result

pytestmark = pytest.mark.real
NEW, OLD = "550.163.01", "535.261.03"
UROOT = "/var/lib/driverd/driver"


@pytest.fixture(scope="module")
def uspk(tmp_path_factory):
    require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    if os.geteuid() != 0:
        missing_component("ldconfig -r ROOT chroots: the user-space crash tests run as root (CI does)")
    t = tmp_path_factory.mktemp("uscrash")
    return {v: build_from_run_dir(usfake.run_dir(t / f"src-{v}", v), t / "out").ref for v in (NEW, OLD)}


@pytest.fixture(scope="module")
def template(tmp_path_factory, uspk):
    """A host tree with the OLD user-space installed (activated)."""
    from driverd.sim.hosttree import HostSpec, write_host
    h = write_host(tmp_path_factory.mktemp("ustemplate") / "h", HostSpec())
    (h / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (h / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    ui.install(h, uspk[OLD].path)
    return h


def us_problems(root: Path, ref, *, kept: tuple = ()) -> list[str]:
    """What is wrong with `root` for 'the user-space package ref is current, complete, active, nothing pending'."""
    r, places, bad = Root(root), ui.Places(), []
    v = ref.manifest.driver_version
    if not ui.is_installed(r, ref.sha256):
        bad.append(f"is_installed({v}) is false (current: {dus.current(r)})")
    if (root / "var/lib/driverd/userspace/pending.json").exists():
        bad.append("a switch is pending")
    found = driverfiles.find(r)
    if found.version != v or not (found.driver_root or "").startswith(f"{UROOT}/{v}"):
        bad.append(f"find() gives {found.version} at {found.driver_root}")
    cache = driverfiles.parse_ld_cache((root / "etc/ld.so.cache").read_bytes())
    first = next((p for k, p in cache if k == "libcuda.so.1"), None)
    if first != f"{UROOT}/current/lib64/libcuda.so.1":
        bad.append(f"the ld cache gives libcuda.so.1 = {first}")
    want = sorted(b.rpartition("/")[2] for b in ref.manifest.binaries)
    have = sorted(n for n in os.listdir(root / "usr/local/bin")
                  if os.readlink(root / "usr/local/bin" / n) == f"{UROOT}/current/bin/{n}")
    if have != want or len(os.listdir(root / "usr/local/bin")) != len(want):
        bad.append(f"PATH links {sorted(os.listdir(root / 'usr/local/bin'))}")
    for d in (root / UROOT.lstrip("/"), root / "etc/ld.so.conf.d", root / "var/lib/driverd/userspace"):
        bad += [f"leftover {d / n}" for n in os.listdir(d) if n.startswith(".")]
    for k in kept:
        if dus.lookup(r, places, k.sha256) is None:
            bad.append(f"the {k.manifest.driver_version} tree is not kept intact")
    return bad


def count_effects(tmp_path, template, *op) -> list[str]:
    root = copy_tree(template, tmp_path / "count")
    trace = tmp_path / "count.trace"
    out = result(pkgop(root, *op, faults={"FAULTS_TRACE": str(trace), "FAULTS_UNDER": str(root)}))
    assert out["ok"], out
    labels = trace.read_text().splitlines()
    assert [int(ln.split()[0]) for ln in labels] == list(range(1, len(labels) + 1))
    return labels


def matrix(tmp_path, template, op, labels, after, forks) -> list[str]:
    def one(n: int) -> list[str]:
        root = copy_tree(template, tmp_path / f"n{n}")
        run = pkgop if n in (1, len(labels)) else forks
        r = run(root, *op, faults={"FAULTS_KILL_AFTER": str(n), "FAULTS_UNDER": str(root)})
        if r.returncode != -signal.SIGKILL:
            return [f"N={n} ({labels[n - 1]}): not killed: rc {r.returncode} {r.stdout[-300:]} {r.stderr[-600:]}"]
        bad = [f"N={n} ({labels[n - 1]}): {p}" for p in after(root, n)]
        if not bad:
            shutil.rmtree(root)
        return bad
    with ThreadPoolExecutor(len(forks.procs)) as ex:
        return [p for ps in ex.map(one, range(1, len(labels) + 1)) for p in ps]


def test_user_space_install_crash_matrix(tmp_path, uspk, template, forks):
    """OLD installed; install(NEW) killed after each effect; then install(NEW) in a new process gives NEW with
    OLD kept, and from the same point restore(OLD) gives OLD."""
    A, B = uspk[OLD], uspk[NEW]
    labels = count_effects(tmp_path, template, "us-install", str(B.path))
    assert any(ln.split()[1] == "run" and "ldconfig" in ln for ln in labels), labels
    assert any(ln.split()[1] == "replace" and ln.endswith("/current") for ln in labels), labels
    assert any(ln.split()[1] == "rename" and ".driverd-staging-" in ln for ln in labels), labels
    assert len(labels) >= 40, labels

    def after(root, n):
        twin = copy_tree(root, root.with_name(root.name + "-restore"))
        out = result(pkgop(twin, "us-restore", A.sha256)) if n in (1, len(labels)) else \
            result(forks(twin, "us-restore", A.sha256))
        bad = [f"restore(OLD) failed: {out.get('error')}"] if not out["ok"] else \
            [f"after restore(OLD): {p}" for p in us_problems(twin, A)]
        if not bad:
            shutil.rmtree(twin)
        out = result(forks(root, "us-install", str(B.path)))
        if not out["ok"]:
            return bad + [f"install(NEW) failed: {out['error']}"]
        return bad + [f"after install(NEW): {p}" for p in us_problems(root, B, kept=(A, B))]
    failures = matrix(tmp_path, template, ("us-install", str(B.path)), labels, after, forks)
    print(f"user-space install crash matrix: {len(labels)} kill points")
    assert not failures, "\n".join(failures[:20])


def test_user_space_restore_crash_matrix(tmp_path, uspk, template, forks):
    """NEW installed over OLD; restore(OLD) killed after each effect; restore(OLD) again ends on OLD, NEW kept."""
    A, B = uspk[OLD], uspk[NEW]
    base = copy_tree(template, tmp_path / "base")
    ui.install(base, B.path)
    labels = count_effects(tmp_path, base, "us-restore", A.sha256)
    assert any("ldconfig" in ln for ln in labels) and len(labels) >= 8, labels

    def after(root, n):
        out = result(forks(root, "us-restore", A.sha256))
        if not out["ok"]:
            return [f"restore(OLD) failed: {out['error']}"]
        return us_problems(root, A, kept=(A, B))
    failures = matrix(tmp_path, base, ("us-restore", A.sha256), labels, after, forks)
    assert not failures, "\n".join(failures[:20])
