"""The companion package format (driverd.package.companion): what a build from NVIDIA's redistributable archive puts in
it, that the same archive gives the same bytes, verification before use, unpacking into a directory fd, the manifest's
checks, and that it never mixes with the kernel-module and user-space packages.

No real NVIDIA archive is reachable from the machines this suite runs on: the archives are made here in NVIDIA's
documented layout, with real ELF libraries (tests/packages/companionfake.py); test_companion_real.py builds from a
real one when it is given."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile

import pytest
import zstandard

from driverd.build.companion import build_from_archive
from driverd.driver.files import elf_soname
from driverd.errors import PackageError
from driverd.package import companion as cp
from driverd.package.archive import read_manifest, unpack, unpack_at, verify_package
from tests.packages import companionfake as cf
from tests.packages import usfake

V = cf.V


@pytest.fixture(scope="module")
def fm(tmp_path_factory):
    t = tmp_path_factory.mktemp("fm")
    a = cf.archive(t / "src", "fabricmanager")
    return a, build_from_archive(a, t / "out", redistrib=cf.redistrib(t / "src", [a]))


def test_a_fabric_manager_archive_gives_its_programs_library_config_data_units_and_links(fm, tmp_path):
    src, res = fm
    m = res.manifest
    assert (m.kind, m.component, m.component_version, m.driver_version, m.branch, m.arch) == \
        ("companion", "fabricmanager", V, V, "550", "x86_64")
    assert res.ref.path.name == f"driverd-companion-fabricmanager-{V}-x86_64.{res.ref.sha256}.tar.zst"
    assert m.binaries == ("bin/nv-fabricmanager", "bin/nvswitch-audit", "sbin/fm_run_package_installer.sh")
    assert [(lib.path, lib.soname) for lib in m.libraries] == [("lib/libnvfm.so.1", "libnvfm.so.1")]
    assert m.configs == ("etc/fabricmanager.cfg",)
    assert m.share == ("share/nvidia/nvswitch/dgx2_hgx2_topology", "share/nvidia/nvswitch/dgxa100_hgxa100_topology")
    assert m.units == ("systemd/nvidia-fabricmanager.service",)
    assert m.docs == ("LICENSE", "third-party-notices.txt")
    assert m.links == (cp.Link("lib/libnvfm.so", "libnvfm.so.1"),)
    # the headers are left out, and the build says why
    assert not any(f.path.startswith("include/") for f in m.files)
    assert res.notes == ["left out include/ (2 files): headers: nothing on a node builds against them"]
    assert res.redistrib == f"redistrib_{V}.json"
    assert m.provenance.archive == cp.Source(src.name, hashlib.sha256(src.read_bytes()).hexdigest(), src.stat().st_size)
    # every file is the archive's, byte for byte, with its mode made 0755 (executable) or 0644
    with tarfile.open(src) as tar:
        inside = {ti.name.split("/", 1)[1]: ti for ti in tar.getmembers() if ti.isreg()}
        for f in m.files:
            ti = inside[f.path]
            assert f.sha256 == hashlib.sha256(tar.extractfile(ti).read()).hexdigest(), f.path
            assert f.mode == (0o755 if ti.mode & 0o111 else 0o644), f.path
    # the manifest as written is what read_manifest gives, and it reads back to the same facts
    d = json.loads(m.dumps())
    assert d["kind"] == "companion" and d["driver"] == {"version": V, "branch": "550"} and d["component"] == "fabricmanager"
    assert cp.CompanionManifest.loads(m.dumps()) == m == read_manifest(res.ref.path, kind="companion")
    assert read_manifest(res.ref.path, kind=None) == m


@pytest.mark.parametrize("component,platform,want", [
    ("nscq", "x86_64", {"arch": "x86_64", "component_version": V, "binaries": ("bin/nscq-cli",),
                        "libraries": ((f"lib/libnvidia-nscq.so.{V}", "libnvidia-nscq.so.2"),),
                        "links": {"lib/libnvidia-nscq.so.2.0": f"libnvidia-nscq.so.{V}",
                                  "lib/libnvidia-nscq.so.2": "libnvidia-nscq.so.2.0",
                                  "lib/libnvidia-nscq.so": "libnvidia-nscq.so.2"}}),
    ("nvlsm", "x86_64", {"arch": "x86_64", "component_version": cf.NVLSM_V, "binaries": ("sbin/nvlsm",),
                         "libraries": (("lib/libgrmapi.so", "libgrmapi.so"),), "links": {}}),
    ("imex", "sbsa", {"arch": "aarch64", "component_version": V,
                      "binaries": ("bin/nvidia-imex", "bin/nvidia-imex-ctl"), "libraries": (), "links": {},
                      "configs": ("etc/nvidia-imex/config.cfg", "etc/nvidia-imex/nodes_config.cfg")}),
])
def test_each_component_by_its_own_layout(tmp_path, component, platform, want):
    a = cf.archive(tmp_path / "src", component, platform=platform)
    # NVLSM is versioned on its own: the driver it goes with is the redistrib JSON's release
    res = build_from_archive(a, tmp_path / "out", redistrib=cf.redistrib(tmp_path / "src", [a], V))
    m = res.manifest
    assert (m.component, m.driver_version, m.arch, m.component_version) == \
        (component, V, want["arch"], want["component_version"])
    assert m.binaries == want["binaries"]
    assert tuple((lib.path, lib.soname) for lib in m.libraries) == want["libraries"]
    assert {ln.path: ln.target for ln in m.links} == want["links"]
    assert m.configs == want.get("configs", ())
    assert res.ref.path.name.startswith(f"driverd-companion-{component}-{V}-{want['arch']}.")


def test_the_same_archive_gives_the_same_package(fm, tmp_path):
    src, res = fm
    assert build_from_archive(src, tmp_path / "again").ref.sha256 == res.ref.sha256     # without the JSON too
    # repacked by someone else — other times, members in the reverse order — the files and links are the same; the
    # package says which archive it came from (its sha256), so it is another package of the same files
    other = cf.archive(tmp_path / "repacked", "fabricmanager", mtime=1, reverse=True)
    assert other.read_bytes() != src.read_bytes()
    again = build_from_archive(other, tmp_path / "out2").manifest
    assert (again.files, again.links, again.libraries) == (res.manifest.files, res.manifest.links, res.manifest.libraries)
    assert again.provenance.archive.sha256 == hashlib.sha256(other.read_bytes()).hexdigest() != \
        res.manifest.provenance.archive.sha256
    # one byte of one file differs: another package
    changed = cf.archive(tmp_path / "changed", "fabricmanager",
                         edit=lambda ms: cf.swap(ms, "etc/fabricmanager.cfg", data=b"LOG_LEVEL=5\n"))
    assert build_from_archive(changed, tmp_path / "out3").ref.sha256 != res.ref.sha256


def test_it_verifies_and_unpacks_into_a_directory_fd(fm, tmp_path):
    _, res = fm
    assert verify_package(res.ref.path, res.ref.sha256, res.ref.size, kind="companion") == res.manifest
    dest = tmp_path / "tree"
    dest.mkdir()
    fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = unpack_at(res.ref.path, fd, res.ref.sha256, res.ref.size, kind="companion")
    finally:
        os.close(fd)
    assert got == res.manifest
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == \
        sorted([f.path for f in got.files] + ["manifest.json"])
    for f in got.files:
        p = dest / f.path
        assert stat.S_IMODE(p.stat().st_mode) == f.mode and hashlib.sha256(p.read_bytes()).hexdigest() == f.sha256
    assert not any(p.is_symlink() for p in dest.rglob("*")), "links are the installer's, never archive members"
    assert elf_soname(str(dest / "lib/libnvfm.so.1")) == "libnvfm.so.1"
    # another sha256 than the index's: refused before a byte is decompressed, nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    fd = os.open(empty, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(PackageError, match="has sha256 .*, expected 0{64}"):
            unpack_at(res.ref.path, fd, "0" * 64, kind="companion")
    finally:
        os.close(fd)
    assert os.listdir(empty) == []


def test_the_kinds_of_package_never_mix(fm, tmp_path):
    from driverd.sim.fakepkg import make_fake_package
    _, res = fm
    plain = usfake.plain_package(tmp_path, V)
    kpkg = make_fake_package(tmp_path / "k", V, "6.1.0-47-cloud-amd64", with_firmware=False)
    with pytest.raises(PackageError) as e:
        verify_package(res.ref.path)                                    # kind "kernel" by default
    assert "is a companion package's manifest, not a kernel-module package's" in e.value.one_line()
    with pytest.raises(PackageError) as e:
        verify_package(res.ref.path, kind="userspace")
    assert "is not a user-space package's manifest (kind 'companion')" in e.value.one_line()
    for other in (plain.path, kpkg.path):
        with pytest.raises(PackageError) as e:
            verify_package(other, kind="companion")
        assert "is not a companion package's manifest" in e.value.one_line()
        with pytest.raises(PackageError):
            unpack(other, tmp_path / "dest", kind="companion")
        assert not (tmp_path / "dest").exists()
    # the other kinds read as they did: each by its own kind, or by the kind its manifest names
    assert read_manifest(plain.path, kind=None).kind == "userspace"
    assert read_manifest(kpkg.path, kind=None).flavor == "open"
    assert verify_package(plain.path, plain.sha256, kind="userspace") == plain.manifest
    assert verify_package(kpkg.path, kpkg.sha256) == kpkg.manifest
    assert verify_package(res.ref.path, kind=None) == res.manifest
    # a kind nobody knows is read as a kernel package's manifest, which refuses it in one line
    bogus = _rewrite(res.ref.path, tmp_path / "bogus.tar.zst", _manifest_edit(lambda d: d.update(kind="firmware")))
    with pytest.raises(PackageError) as e:
        read_manifest(bogus, kind=None)
    assert "is a firmware package's manifest, not a kernel-module package's" in e.value.one_line()
    with pytest.raises(PackageError, match="unexpected directory 'bin'"):
        verify_package(bogus, kind=None)                            # its members checked by the kernel layout


# -- what a companion package may not hold, whoever made it -------------------------------------------

def _rewrite(package, out, edit):
    """The package's tar with `edit(name, TarInfo, data) -> (TarInfo, data)` applied to every member; `extra`
    members (TarInfo, data) appended."""
    src = tarfile.open(fileobj=io.BytesIO(zstandard.ZstdDecompressor().stream_reader(open(package, "rb")).read()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for ti in src.getmembers():
            data = src.extractfile(ti).read() if ti.isreg() else None
            ti, data = edit(ti.name, ti, data)
            dst.addfile(ti, io.BytesIO(data) if data is not None else None)
        for ti, data in getattr(edit, "extra", ()):
            dst.addfile(ti, io.BytesIO(data) if data is not None else None)
    out.write_bytes(zstandard.ZstdCompressor(level=1).compress(buf.getvalue()))
    return out


def _manifest_edit(change):
    def edit(name, ti, data):
        if name == "manifest.json":
            d = json.loads(data)
            change(d)
            data = json.dumps(d).encode()
            ti.size = len(data)
        return ti, data
    return edit


def _file(d, path):
    return next(f for f in d["files"] if f["path"] == path)


def _member(name, data=b"x", kind=tarfile.REGTYPE, link=""):
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname, ti.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    return ti, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize("case,expect", [
    ("setuid", "file bin/nv-fabricmanager has mode 4755; a companion package holds 0644 and 0755 only"),
    ("link-out", "link lib/libevil.so -> ../../etc/passwd points out of the tree"),
    ("link-absolute", "link lib/libevil.so -> /etc/passwd points out of the tree"),
    ("link-dangling", "link lib/libnvfm.so -> libnvfm.so.2 does not end at a listed file of the package"),
    ("absolute-path", "file path '/etc/passwd' is outside the companion layout"),
    ("dotdot-path", "file path 'lib/../../etc/passwd' is outside the companion layout"),
    ("binaries", "its binaries list disagrees with its files at bin/nvswitch-audit"),
    ("soname", "libnvfm.so.1 declares the soname libc.so.6, not one of libnvfm's"),
    ("version", "fabricmanager 535.261.03 is not driver 550.163.01's: it must be exactly the driver's version"),
    ("component", "unknown component 'cuda'"),
    ("symlink-member", "is a symlink"),
    ("outside-member", "member 'boot/vmlinuz' is outside manifest.json, bin/, sbin/, lib/, etc/, share/, systemd/"),
    ("extra-member", "bin/extra is in the archive but not in the manifest"),
])
def test_what_a_companion_package_may_not_hold(fm, tmp_path, case, expect):
    _, res = fm
    changes = {
        "setuid": lambda d: _file(d, "bin/nv-fabricmanager").update(mode=0o4755),
        "link-out": lambda d: d["links"].append({"path": "lib/libevil.so", "target": "../../etc/passwd"}),
        "link-absolute": lambda d: d["links"].append({"path": "lib/libevil.so", "target": "/etc/passwd"}),
        "link-dangling": lambda d: d["links"][0].update(target="libnvfm.so.2"),
        "absolute-path": lambda d: _file(d, "LICENSE").update(path="/etc/passwd"),
        "dotdot-path": lambda d: _file(d, "LICENSE").update(path="lib/../../etc/passwd"),
        "binaries": lambda d: d["binaries"].remove("bin/nvswitch-audit"),
        "soname": lambda d: d["libraries"][0].update(soname="libc.so.6"),
        "version": lambda d: d.update(component_version="535.261.03"),
        "component": lambda d: d.update(component="cuda"),
    }
    edit = _manifest_edit(changes.get(case, lambda d: None))
    if case == "symlink-member":
        edit.extra = [_member("lib/libnvfm.so", kind=tarfile.SYMTYPE, link="libnvfm.so.1")]
    elif case == "outside-member":
        edit.extra = [_member("boot/vmlinuz")]
    elif case == "extra-member":
        edit.extra = [_member("bin/extra")]
    bad = _rewrite(res.ref.path, tmp_path / "bad.tar.zst", edit)
    with pytest.raises(PackageError) as e:
        verify_package(bad, kind="companion")
    line = e.value.one_line()
    assert expect in line and len(line.splitlines()) == 1, line
    with pytest.raises(PackageError):
        unpack(bad, tmp_path / "dest", kind="companion")
    assert not (tmp_path / "dest").exists()


def test_the_manifest_bounds_what_it_lists():
    f = cp.FileEntry("share/x", cp.MAX_FILE_BYTES + 1, 0o644, "0" * 64)
    m = cp.CompanionManifest("imex", V, V, "x86_64", files=(f,), share=("share/x",))
    with pytest.raises(PackageError, match="file share/x has an invalid size or sha256"):
        m.validate()
    many = tuple(cp.FileEntry(f"share/{i}", 1, 0o644, "0" * 64) for i in range(cp.MAX_FILES + 1))
    with pytest.raises(PackageError, match=f"{cp.MAX_FILES + 1} files \\(at most {cp.MAX_FILES}\\)"):
        cp.CompanionManifest("imex", V, V, "x86_64", files=many, share=tuple(x.path for x in many)).validate()
    deep = "share/" + "/".join("d" * 8) + "/x"
    with pytest.raises(PackageError, match="outside the companion layout"):
        cp.CompanionManifest("imex", V, V, "x86_64", files=(cp.FileEntry(deep, 1, 0o644, "0" * 64),),
                             share=(deep,)).validate()
    with pytest.raises(PackageError, match="arch 'ppc64le' is not one of x86_64, aarch64"):
        cp.CompanionManifest("imex", V, V, "ppc64le", files=()).validate()
