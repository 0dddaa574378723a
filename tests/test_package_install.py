"""Package format, verification, safe unpack and install into a host root, with the real kmod tools."""
from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from driverd.errors import PackageError
from driverd.host import collect
from driverd.package import archive
from driverd.install import checks
from driverd.install import modules as inst
from driverd.package.archive import read_manifest, unpack, verify_package
from driverd.package.manifest import MANIFEST_NAME
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim import fakemod
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, write_host
from tests.conftest import require_binary, run_cli

REL = "6.1.0-47-cloud-amd64"
pytestmark = pytest.mark.real


@pytest.fixture(autouse=True)
def _kmod(kmod_tools):
    return kmod_tools


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory):
    """Fake packages: v535 (unsigned), v550 (unsigned), v550 signed, and one for another kernel."""
    d = tmp_path_factory.mktemp("pkgs")
    signer = fakemod.test_signer(tmp_path_factory.mktemp("key"))
    return {
        "535": make_fake_package(d, "535.261.03", REL),
        "550": make_fake_package(d, "550.127.05", REL),
        "550s": make_fake_package(d / "signed", "550.127.05", REL, signer=signer),
        "other": make_fake_package(d, "550.127.05", "6.1.0-56-cloud-amd64"),
    }


@pytest.fixture
def host(tmp_path):
    return write_host(tmp_path / "host", HostSpec(release=REL))


def tree(root: Path) -> dict[str, str]:
    """Every file under root with its content digest: 'leaves the host as it was' is tree(before) == tree(after)."""
    import hashlib
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in fns + [d for d in dns if os.path.islink(os.path.join(dp, d))]:
            p = os.path.join(dp, n)
            out[os.path.relpath(p, root)] = "link" if os.path.islink(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()
        for d in dns:
            out.setdefault(os.path.relpath(os.path.join(dp, d), root) + "/", "dir")
    return out


def show_depends(root: Path, name: str = "nvidia_uvm") -> list[str]:
    mp = require_binary("modprobe", "/usr/sbin/modprobe")
    out = subprocess.run([mp, "-d", str(root), "-S", REL, "--show-depends", name], capture_output=True, text=True,
                         check=True).stdout
    return [ln.split()[1] for ln in out.splitlines()]


# -- install / rollback -------------------------------------------------------------------------

def test_install_layout_depmod_and_facts(host, pkgs):
    rep = inst.install(host, pkgs["535"].path, Runner())
    mdir = host / "lib/modules" / REL / "updates/driverd"
    assert rep.changed and rep.modules_dir == str(mdir)
    assert sorted(p.name for p in mdir.iterdir()) == ["install.json", "manifest.json", "nvidia-drm.ko",
                                                       "nvidia-modeset.ko", "nvidia-peermem.ko", "nvidia-uvm.ko",
                                                       "nvidia.ko"]
    rec = json.loads((mdir / "install.json").read_text())
    assert rec["package_sha256"] == pkgs["535"].sha256 and rec["installed_at"]
    assert sorted(os.listdir(host / "lib/firmware/nvidia/535.261.03")) == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    # the real depmod ran: modprobe resolves the dependency chain in the installed tree
    assert [Path(p).name for p in show_depends(host)] == ["nvidia.ko", "nvidia-uvm.ko"]
    assert rep.resolves == [str(mdir / "nvidia.ko")]
    # the host fact reader sees the installation
    facts = collect(Root(host), nvml=False)
    (ip,) = facts.driver.installed
    assert (ip.driver_version, ip.flavor, ip.kernel_release, ip.sha256) == ("535.261.03", "open", REL,
                                                                              pkgs["535"].sha256)


def test_reinstall_same_package_changes_nothing(host, pkgs):
    inst.install(host, pkgs["535"].path, Runner())
    before = tree(host)
    rep = inst.install(host, pkgs["535"].path, Runner())
    assert not rep.changed and tree(host) == before


def test_upgrade_keeps_previous_and_rollback_swaps(host, pkgs):
    inst.install(host, pkgs["535"].path, Runner())
    rep = inst.install(host, pkgs["550"].path, Runner())
    state = host / "var/lib/driverd/packages"
    kept = state / "kept" / pkgs["535"].sha256
    assert rep.previous == str(kept)
    assert json.loads((kept / "modules/manifest.json").read_text())["driver"]["version"] == "535.261.03"
    assert json.loads((state / "previous" / f"{REL}.json").read_text())["sha256"] == pkgs["535"].sha256
    assert inst.previous_sha(host, REL) == (True, pkgs["535"].sha256)
    assert sorted(os.listdir(kept / "firmware/535.261.03")) == ["gsp_ga10x.bin", "gsp_tu10x.bin"]
    assert not (state / f"pending-{REL}.json").exists()
    # firmware of both versions stays: 535's is what a rollback needs
    assert sorted(os.listdir(host / "lib/firmware/nvidia")) == ["535.261.03", "550.127.05"]
    # no staging or holding directory is left in the module tree (depmod must never see two nvidia.ko)
    kos = [p for p in (host / "lib/modules").rglob("*.ko")]
    assert len(kos) == 5
    assert not [n for n in os.listdir(host / "lib/modules" / REL / "updates") if n != "driverd"]
    r = Runner()
    inst.rollback_install(host, REL, r)
    m = json.loads((host / "lib/modules" / REL / "updates/driverd/manifest.json").read_text())
    assert m["driver"]["version"] == "535.261.03"
    assert inst.is_installed(host, REL, pkgs["535"].sha256)
    assert any(res.argv[1:] == ("-b", str(host), REL) for res in r.history)
    assert inst.previous_sha(host, REL) == (True, pkgs["550"].sha256)
    assert [Path(p).name for p in show_depends(host)] == ["nvidia.ko", "nvidia-uvm.ko"]
    inst.rollback_install(host, REL, Runner())   # and back again
    assert json.loads((host / "lib/modules" / REL / "updates/driverd/manifest.json").read_text())["driver"][
        "version"] == "550.127.05"
    assert inst.is_installed(host, REL, pkgs["550"].sha256)
    assert inst.previous_sha(host, REL) == (True, pkgs["535"].sha256)


def test_rollback_of_first_install_removes_it(host, pkgs):
    inst.install(host, pkgs["535"].path, Runner())
    assert inst.previous_sha(host, REL) == (True, None)
    inst.rollback_install(host, REL, Runner())
    assert not (host / "lib/modules" / REL / "updates/driverd").exists()
    assert collect(Root(host), nvml=False).driver.installed == ()
    assert inst.is_installed(host, REL, None)
    inst.rollback_install(host, REL, Runner())          # and back: the removed one was kept
    assert inst.is_installed(host, REL, pkgs["535"].sha256)


def test_rollback_without_previous_is_refused(host):
    before = tree(host)
    with pytest.raises(PackageError, match="nothing to roll back to: no previous installation") as ei:
        inst.rollback_install(host, REL, Runner())
    assert "\n" not in ei.value.one_line()
    assert tree(host) == before


# -- bad input: one line, host unchanged ----------------------------------------------------------

def _refused(host, pkg, match, **kw):
    before = tree(host)
    with pytest.raises(PackageError, match=match) as ei:
        inst.install(host, pkg, Runner(), **kw)
    assert "\n" not in ei.value.one_line()
    assert tree(host) == before
    return ei.value


def test_vermagic_for_another_kernel(host, pkgs):
    e = _refused(host, pkgs["other"].path, "package is for kernel 6.1.0-56-cloud-amd64, the target kernel is "
                 + REL)
    assert e.exit_code == 3


def test_vermagic_differs_from_kernel_modules(host, tmp_path):
    """Same release name, different vermagic than the kernel's own in-tree modules."""
    fakemod.write_module(fakemod.FakeModule("ext4", vermagic=f"{REL} SMP mod_unload "),
                         host / "lib/modules" / REL / "kernel/fs")
    pkg = make_fake_package(tmp_path / "p", "535.261.03", REL)   # vermagic has preempt+modversions
    _refused(host, pkg.path, "differs from kernel")


def test_vermagic_of_compressed_kernel_modules(host, tmp_path):
    """The kernel's own modules compressed (Ubuntu ships .ko.zst) are read from the file (.modinfo);
    a damaged one is one clear line, nothing written."""
    d = host / "lib/modules" / REL / "kernel/fs"
    ko = fakemod.write_module(fakemod.FakeModule("ext4", vermagic=f"{REL} SMP mod_unload "), d)
    ko.with_name("ext4.ko.zst").write_bytes(zstandard.ZstdCompressor().compress(ko.read_bytes()))
    ko.unlink()
    pkg = make_fake_package(tmp_path / "p", "535.261.03", REL)
    assert checks.kernel_vermagic(Root(host), REL) == f"{REL} SMP mod_unload"
    _refused(host, pkg.path, "differs from kernel")
    (d / "ext4.ko.zst").write_bytes(b"not zstd")
    _refused(host, pkg.path, "cannot read kernel .* module .*ext4.ko.zst: cannot decompress")


def test_unsigned_modules_under_enforcement(tmp_path, pkgs):
    host = write_host(tmp_path / "h", HostSpec(release=REL, sig_enforce=True))
    e = _refused(host, pkgs["550"].path, r"refusing unsigned modules \(nvidia")
    assert "sig_enforce=Y" in e.one_line() and "--sign-key" in e.one_line()
    rep = inst.install(host, pkgs["550s"].path, Runner())    # signed: accepted
    assert rep.changed


def test_disk_full_during_install(host, pkgs, monkeypatch):
    """ENOSPC on the third file written: staging is removed, the host is as it was."""
    real_open = os.fdopen
    calls = {"n": 0}

    class Full:
        def __init__(self, f):
            self.f = f
        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        def __enter__(self):
            return self
        def __exit__(self, *a):
            self.f.close()
        def close(self):
            self.f.close()

    def fdopen(fd, *a, **kw):
        f = real_open(fd, *a, **kw)
        calls["n"] += 1
        return Full(f) if calls["n"] == 3 else f
    monkeypatch.setattr(archive.os, "fdopen", fdopen)
    _refused(host, pkgs["535"].path, "disk full while installing")
    assert calls["n"] >= 3


def test_disk_full_up_front(host, pkgs, monkeypatch):
    import collections
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - 1024, 1024))
    _refused(host, pkgs["535"].path, "not enough space")


def test_depmod_failure_restores_previous(host, pkgs):
    inst.install(host, pkgs["535"].path, Runner())
    before = tree(host)
    from driverd.errors import ModuleError
    from driverd.kmod.kernel import RealKernel

    class FailingDepmod(RealKernel):      # the real kmod tools, but the checked depmod fails
        def depmod(self, release, check=True):
            if check:
                raise ModuleError("depmod failed for x")
            return super().depmod(release, check=False)
    with pytest.raises(PackageError, match="depmod failed"):
        inst.install(host, pkgs["550"].path, Runner(), kernel_tools=FailingDepmod(Root(host), Runner()))
    after = tree(host)
    assert {k: v for k, v in after.items() if "modules." not in k} == \
           {k: v for k, v in before.items() if "modules." not in k}


# -- archive-level refusals -----------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, mutate) -> Path:
    """Copy a package member by member through `mutate(tarinfo, data) -> list[(tarinfo, data)]`."""
    members = []
    with archive._open_stream(src) as tar:
        for ti in tar:
            data = tar.extractfile(ti).read() if ti.isreg() else b""
            members.append((ti, data))
    out = []
    for ti, data in members:
        out.extend(mutate(ti, data))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for ti, data in out:
            ti.size = len(data) if ti.isreg() else 0
            t.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    dst.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    return dst


def _extra(kind: str):
    def mutate(ti, data):
        out = [(ti, data)]
        if ti.name == "modules/nvidia.ko":
            x = tarfile.TarInfo({"abs": "/etc/evil.ko", "dotdot": "modules/../../evil.ko", "symlink": "modules/evil.ko",
                                 "device": "modules/sda", "hardlink": "modules/h.ko"}[kind])
            if kind == "symlink":
                x.type, x.linkname = tarfile.SYMTYPE, "/etc/shadow"
            elif kind == "hardlink":
                x.type, x.linkname = tarfile.LNKTYPE, "modules/nvidia.ko"
            elif kind == "device":
                x.type, x.devmajor, x.devminor = tarfile.BLKTYPE, 8, 0
            out.append((x, b"x" if kind in ("abs", "dotdot") else b""))
        return out
    return mutate


@pytest.mark.parametrize("kind,match", [("abs", "absolute path"), ("dotdot", r"contains '\.\.'"),
                                        ("symlink", "is a symlink"), ("hardlink", "is a hard link"),
                                        ("device", "device node")])
def test_unsafe_members_refused(tmp_path, host, pkgs, kind, match):
    bad = _rewrite(pkgs["535"].path, tmp_path / "bad.tar.zst", _extra(kind))
    with pytest.raises(PackageError, match=match):
        unpack(bad, tmp_path / "u")
    assert not (tmp_path / "u").exists()
    assert not (tmp_path / "etc").exists()
    _refused(host, bad, match)


def test_manifest_disagrees_with_files(tmp_path, host, pkgs):
    def flip(ti, data):
        if ti.name == "modules/nvidia-uvm.ko":
            data = data[:-1] + bytes([data[-1] ^ 1])
        return [(ti, data)]
    bad = _rewrite(pkgs["535"].path, tmp_path / "bad.tar.zst", flip)
    _refused(host, bad, r"modules/nvidia-uvm.ko: sha256 is [0-9a-f]+, the manifest says")

    def drop(ti, data):
        return [] if ti.name == "firmware/gsp_tu10x.bin" else [(ti, data)]
    bad2 = _rewrite(pkgs["535"].path, tmp_path / "bad2.tar.zst", drop)
    _refused(host, bad2, "manifest lists firmware/gsp_tu10x.bin, which the archive lacks")

    def unlisted(ti, data):
        out = [(ti, data)]
        if ti.name == "modules/nvidia.ko":
            x = tarfile.TarInfo("modules/rootkit.ko")
            x.mode = 0o644
            out.append((x, b"\x7fELF"))
        return out
    bad3 = _rewrite(pkgs["535"].path, tmp_path / "bad3.tar.zst", unlisted)
    _refused(host, bad3, "modules/rootkit.ko is in the archive but not in the manifest")

    def mode(ti, data):
        if ti.name == "modules/nvidia.ko":
            ti.mode = 0o4755
        return [(ti, data)]
    bad4 = _rewrite(pkgs["535"].path, tmp_path / "bad4.tar.zst", mode)
    _refused(host, bad4, "mode is 0o755, the manifest says 0o644")


def test_truncated_and_wrong_sha(tmp_path, host, pkgs):
    data = pkgs["535"].path.read_bytes()
    cut = tmp_path / "cut.tar.zst"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackageError, match="truncated or corrupt"):
        verify_package(cut)
    _refused(host, cut, "truncated or corrupt")
    with pytest.raises(PackageError, match="has sha256 .* expected 0000"):
        verify_package(pkgs["535"].path, "0" * 64)


def test_manifest_is_first_member_and_validated(tmp_path, pkgs):
    m = read_manifest(pkgs["550s"].path)
    assert m.signed and m.modules[0].sig_hashalgo == "sha256"

    def evil(ti, data):
        if ti.name == MANIFEST_NAME:
            d = json.loads(data)
            d["kernel"]["release"] = "../../etc"
            data = json.dumps(d).encode()
        return [(ti, data)]
    bad = _rewrite(pkgs["535"].path, tmp_path / "bad.tar.zst", evil)
    with pytest.raises(PackageError, match="kernel release '../../etc' is not a plain name"):
        read_manifest(bad)


# -- CLI ------------------------------------------------------------------------------------------

def test_cli_install_json_and_refusal(host, pkgs):
    r = run_cli("install", "--root", str(host), str(pkgs["535"].path), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["state"] == "done" and out["command"] == "install" and out["journal"]
    assert out["report"]["sha256"] == pkgs["535"].sha256 and out["report"]["changed"] is True
    journal = (host / "var/lib/driverd/journal.json").read_bytes()
    r = run_cli("install", "--root", str(host), str(pkgs["other"].path))
    assert r.returncode == 3
    assert r.stderr.count("\n") == 1 and "package is for kernel 6.1.0-56-cloud-amd64" in r.stderr
    assert (host / "var/lib/driverd/journal.json").read_bytes() == journal      # refused before any run
    r = run_cli("install", "--root", str(host), "/nonexistent.tar.zst")
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run_cli("rollback-install", "--root", str(host), "--kernel", REL, "--json")
    assert r.returncode == 0, r.stderr


def test_install_dry_run_checks_everything_and_writes_nothing(tmp_path):
    import hashlib
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.hosttree import HostSpec, write_host
    from tests.conftest import run_cli
    root = write_host(tmp_path / "host", HostSpec())
    pkg = make_fake_package(tmp_path / "repo", "535.261.03", "6.1.0-47-cloud-amd64").path
    snap = lambda: {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "d" for p in root.rglob("*")}
    before = snap()
    r = run_cli("install", "--root", str(root), str(pkg), "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dry_run"] is True and snap() == before
    other = make_fake_package(tmp_path / "other", "535.261.03", "6.1.0-50-cloud-amd64").path
    r = run_cli("install", "--root", str(root), str(other), "--dry-run", "--kernel", "6.1.0-47-cloud-amd64")
    assert r.returncode == 3 and "vermagic" in r.stderr.lower() and snap() == before
