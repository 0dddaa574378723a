"""The user-space package format (driverd.package.userspace): what a build from NVIDIA's .run layout puts in
it (a miniature .run directory of real ELF objects compiled with the driver's sonames: tests/packages/usfake.py),
the manifest's checks, verification before use, and that it and the kernel-module package never mix."""
from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile

import pytest
import zstandard

from driverd.errors import PackageError
from driverd.package import userspace as us
from driverd.package.archive import read_manifest, unpack, verify_package
from driverd.build.userspace import build_from_run_dir
from tests.conftest import run_cli
from tests.packages import usfake

V = "550.163.01"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    t = tmp_path_factory.mktemp("run")
    d = usfake.run_dir(t / "src", V)
    return d, build_from_run_dir(d, t / "out")


def test_a_run_directory_gives_the_versioned_libraries_with_their_sonames_binaries_firmware_and_icds(built):
    src, res = built
    m = res.manifest
    assert (m.driver_version, m.arch, m.kind, m.provenance.source) == (V, "x86_64", "userspace", "nvidia-run")
    assert {lib.path: lib.soname for lib in m.libraries} == {
        f"lib64/libcuda.so.{V}": "libcuda.so.1", f"lib64/libnvidia-ml.so.{V}": "libnvidia-ml.so.1",
        f"lib64/libnvidia-ptxjitcompiler.so.{V}": "libnvidia-ptxjitcompiler.so.1",
        f"lib64/libnvidia-nvvm.so.{V}": "libnvidia-nvvm.so.4", f"lib64/libnvidia-eglcore.so.{V}": f"libnvidia-eglcore.so.{V}",
        f"lib64/libEGL_nvidia.so.{V}": "libEGL_nvidia.so.0", f"lib64/libGLX_nvidia.so.{V}": "libGLX_nvidia.so.0",
        f"lib64/libnvcuvid.so.{V}": "libnvcuvid.so.1"}
    assert m.components() == {"compute": 3, "graphics": 3, "utility": 1, "video": 1}
    # the soname link of every library not named after its soname, and Debian's development links
    links = {ln.path: ln.target for ln in m.links}
    assert links["lib64/libcuda.so.1"] == f"libcuda.so.{V}" and links["lib64/libcuda.so"] == "libcuda.so.1"
    assert links["lib64/libnvidia-nvvm.so.4"] == f"libnvidia-nvvm.so.{V}" and links["lib64/libnvcuvid.so"] == "libnvcuvid.so.1"
    assert f"lib64/libnvidia-eglcore.so.{V}" not in links and "lib64/libnvidia-nvvm.so" not in links
    assert len(links) == 10
    assert [b.rpartition("/")[2] for b in m.binaries] == ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
                                                          "nvidia-debugdump", "nvidia-modprobe", "nvidia-persistenced",
                                                          "nvidia-smi"]
    assert [f.path for f in m.firmware_files] == [f"firmware/nvidia/{V}/gsp_ga10x.bin", f"firmware/nvidia/{V}/gsp_tu10x.bin"]
    paths = {f.path for f in m.files}
    # the X server's module, nvidia-installer, another version's library and the 32-bit ones are not the node's
    assert not any("glxserver" in p or "wayland" in p or "installer" in p for p in paths)
    assert {p for p in paths if p.startswith("share/")} == {"share/glvnd/egl_vendor.d/10_nvidia.json",
                                                             "share/vulkan/icd.d/nvidia_icd.json"}
    assert any("kernel-open/ holds the open kernel-module sources" in n for n in res.notes)
    assert any("libnvidia-egl-wayland.so.1.1.13" in n and "not a library of driver" in n for n in res.notes)
    # every file is the source's, byte for byte
    for f in m.files:
        name = f.path.rpartition("/")[2]
        src_file = src / "firmware" / name if f.path.startswith("firmware/") else src / name
        if f.path.endswith("nvidia_icd.json"):
            continue
        assert f.sha256 == hashlib.sha256(src_file.read_bytes()).hexdigest(), f.path
        assert f.mode == (0o755 if f.path.startswith("bin/") else 0o644), f.path
    assert res.ref.path.name == f"driverd-userspace-{V}-x86_64.{res.ref.sha256}.tar.zst"


def test_the_vulkan_template_gets_the_library_nvidia_installer_writes(built, tmp_path):
    _, res = built
    d = tmp_path / "u"
    unpack(res.ref.path, d, kind="userspace")
    icd = json.loads((d / "share/vulkan/icd.d/nvidia_icd.json").read_text())
    assert icd["ICD"]["library_path"] == "libGLX_nvidia.so.0"
    # unpacking writes what the verified manifest says: 0755 binaries, 0644 the rest, never setuid
    assert stat.S_IMODE((d / "bin/nvidia-modprobe").stat().st_mode) == 0o755
    assert stat.S_IMODE((d / f"lib64/libcuda.so.{V}").stat().st_mode) == 0o644
    assert not any(p.is_symlink() for p in d.rglob("*")), "links are the installer's, never archive members"


def test_the_same_inputs_give_the_same_package(built, tmp_path):
    src, res = built
    again = build_from_run_dir(src, tmp_path / "again")
    assert again.ref.sha256 == res.ref.sha256


def test_an_icd_file_whose_library_is_missing_is_left_out(tmp_path):
    d = usfake.run_dir(tmp_path / "src", V, icd_template=False)
    (d / f"libGLX_nvidia.so.{V}").unlink()
    res = build_from_run_dir(d, tmp_path / "out")
    assert not any(f.path.endswith("nvidia_icd.json") for f in res.manifest.files)
    assert any("nvidia_icd.json" in n and "libGLX_nvidia.so.0 is not in the package" in n for n in res.notes)


def test_a_source_of_two_versions_or_without_libcuda_is_refused_in_one_line(tmp_path):
    d = usfake.run_dir(tmp_path / "src", V)
    os.rename(d / f"libnvidia-ml.so.{V}", d / "libnvidia-ml.so.535.261.03")
    with pytest.raises(PackageError) as e:
        build_from_run_dir(d, tmp_path / "out")
    assert "more than one driver version (535.261.03, 550.163.01)" in e.value.one_line()
    assert "fix: put the packages of one driver version" in e.value.one_line()
    (d / "libnvidia-ml.so.535.261.03").unlink()
    (d / f"libcuda.so.{V}").unlink()
    with pytest.raises(PackageError, match=r"no libcuda\.so\.<version> or libnvidia-ml\.so\.<version>") as e:
        build_from_run_dir(d, tmp_path / "out")
    assert len(e.value.one_line().splitlines()) == 1
    assert not list(tmp_path.glob("out/*.tar.zst"))


# -- verified before use -----------------------------------------------------------------------------

def _tar_of(package) -> bytes:
    return zstandard.ZstdDecompressor().stream_reader(open(package, "rb")).read()


def _write(path, tar: bytes):
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(tar))
    return path


def _rewrite(package, out, edit):
    """The package's tar with `edit(name, TarInfo, data) -> (TarInfo, data) | None` applied to every member."""
    src = tarfile.open(fileobj=io.BytesIO(_tar_of(package)))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for ti in src.getmembers():
            data = src.extractfile(ti).read() if ti.isreg() else None
            r = edit(ti.name, ti, data)
            if r is None:
                continue
            ti, data = r
            dst.addfile(ti, io.BytesIO(data) if data is not None else None)
    return _write(out, buf.getvalue())


@pytest.fixture
def plain(tmp_path):
    return usfake.plain_package(tmp_path, V)


def test_a_tampered_file_is_refused_and_nothing_is_left(plain, tmp_path):
    def flip(name, ti, data):
        if name == f"lib64/libcuda.so.{V}":
            data = b"CUDA"                                   # same size, other bytes
        return ti, data
    bad = _rewrite(plain.path, tmp_path / "bad.tar.zst", flip)
    with pytest.raises(PackageError) as e:
        verify_package(bad, kind="userspace")
    assert f"lib64/libcuda.so.{V}: sha256 is" in e.value.message and "the manifest says" in e.value.message
    with pytest.raises(PackageError):
        unpack(bad, tmp_path / "dest", kind="userspace")
    assert not (tmp_path / "dest").exists()
    # the untouched package verifies, and its manifest is what was packed
    assert verify_package(plain.path, kind="userspace") == plain.manifest


@pytest.mark.parametrize("case,expect", [
    ("symlink", "is a symlink"),
    ("outside", "outside manifest.json, lib64/, bin/, firmware/nvidia/<version>/ and share/"),
    ("setuid", "has mode 4755; a user-space package holds 0644 and 0755 only"),
    ("link-out", "is not a name in lib64/ pointing at a name beside it"),
    ("link-dangling", "does not end at a listed file of its directory"),
    ("no-nvml", "no libnvidia-ml.so.1: a user-space package needs libcuda and libnvidia-ml"),
    ("extra", "is in the archive but not in the manifest"),
])
def test_what_a_user_space_package_may_not_hold(plain, tmp_path, case, expect):
    def edit(name, ti, data):
        if name == "manifest.json":
            d = json.loads(data)
            if case == "setuid":
                next(f for f in d["files"] if f["path"] == "bin/nvidia-smi")["mode"] = 0o4755
            elif case == "link-out":
                d["links"].append({"path": "lib64/libevil.so", "target": "../../etc/passwd"})
            elif case == "link-dangling":
                d["links"].append({"path": "lib64/libnvidia-ml.so", "target": "libnvidia-ml.so.2"})
            elif case == "no-nvml":
                d["libraries"] = [x for x in d["libraries"] if x["soname"] != "libnvidia-ml.so.1"]
            data = json.dumps(d).encode()
            ti.size = len(data)
        return ti, data

    bad = _rewrite(plain.path, tmp_path / "bad.tar.zst", edit)
    if case in ("symlink", "outside", "extra"):
        buf = io.BytesIO(_tar_of(bad))
        with tarfile.open(fileobj=buf, mode="a") as t:
            if case == "symlink":
                ti = tarfile.TarInfo("lib64/libcuda.so.1")
                ti.type, ti.linkname = tarfile.SYMTYPE, f"libcuda.so.{V}"
                t.addfile(ti)
            else:
                ti = tarfile.TarInfo("etc/passwd" if case == "outside" else "lib64/libextra.so.1")
                ti.size = 4
                t.addfile(ti, io.BytesIO(b"root"))
        _write(bad, buf.getvalue())
    with pytest.raises(PackageError) as e:
        verify_package(bad, kind="userspace")
    line = e.value.one_line()
    assert expect in line and len(line.splitlines()) == 1, line


def test_the_two_kinds_of_package_never_mix(plain, tmp_path):
    from driverd.install.modules import install
    from driverd.sim.fakepkg import make_fake_package
    kpkg = make_fake_package(tmp_path / "k", "550.163.01", "6.1.0-47-cloud-amd64", with_firmware=False)
    with pytest.raises(PackageError) as e:
        install(tmp_path / "host", plain.path)
    assert "is a userspace package's manifest, not a kernel-module package's" in e.value.one_line()
    with pytest.raises(PackageError) as e:
        verify_package(kpkg.path, kind="userspace")
    assert "is not a user-space package's manifest" in e.value.one_line()
    with pytest.raises(PackageError, match="not a kernel-module package's"):
        verify_package(plain.path)                                    # kind "kernel" by default, unchanged
    assert read_manifest(plain.path, kind=None).kind == "userspace"
    assert read_manifest(kpkg.path, kind=None).flavor == "open"


def test_the_repository_index_lists_user_space_packages_beside_the_kernel_ones(plain, tmp_path):
    import shutil
    from driverd.repo.index import INDEX_NAME, parse_index, write_index
    from driverd.sim.fakepkg import make_fake_package
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(plain.path, repo)
    make_fake_package(repo, "550.163.01", "6.1.0-47-cloud-amd64", with_firmware=False)
    idx = write_index(repo)
    assert len(idx.packages) == 1 and len(idx.userspace) == 1
    back = parse_index((repo / INDEX_NAME).read_bytes(), "index")
    e = back.find_userspace(V, "x86_64")
    assert e is not None and (e.sha256, e.path) == (plain.sha256, plain.path.name)
    assert back.find(V, "open", "6.1.0-47-cloud-amd64", "x86_64") is not None
    assert back.find_userspace("535.261.03", "x86_64") is None


def test_the_manifest_json_round_trips(plain):
    m = plain.manifest
    assert us.UserspaceManifest.loads(m.dumps()) == m
    d = json.loads(m.dumps())
    assert d["kind"] == "userspace" and d["driver"] == {"version": V, "branch": "550"}


def test_build_userspace_command(tmp_path):
    d = usfake.run_dir(tmp_path / "src", V)
    res = run_cli("build-userspace", "--from-run-dir", str(d), "--out", str(tmp_path / "out"), "--json", check=True)
    out = json.loads(res.stdout)
    assert out["driver"] == V and out["libraries"][f"libcuda.so.{V}"] == "libcuda.so.1"
    assert (tmp_path / "out" / os.path.basename(out["package"])).is_file()
    res = run_cli("build-userspace", "--from-debs", str(tmp_path / "nothing"), "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "fix:" in res.stderr
    (tmp_path / "empty").mkdir()
    res = run_cli("build-userspace", "--from-debs", str(tmp_path / "empty"), "--out", str(tmp_path / "out"))
    assert res.returncode == 3 and "no .deb files in" in res.stderr and "fix:" in res.stderr
