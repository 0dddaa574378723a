"""User-space packages built from NVIDIA's real user-space as Debian ships it: 535.261.03 (bookworm non-free)
and 550.163.01 (sid), the .debs `.ci/install-components` downloads into $DRIVERD_CI_PREFIX/nvidia-userspace/
<version>/. Checked against Debian's own tools (dpkg-deb for the files and links, readelf for the sonames), then
installed, switched and rolled back on a host tree with the real ldconfig, and the real nvidia-smi run from
the tree. The .run format test builds an installer with makeself from these real files (a real NVIDIA .run
cannot be downloaded here) and packs what it extracts."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from driverd.driver import files as driverfiles
from driverd.errors import PackageError
from driverd.install import userspace as ui
from driverd.package.archive import verify_package
from driverd.build.userspace import build_from_debs, build_from_run_dir
from driverd.root import Root
from tests.conftest import CI_PREFIX, missing_component, require_binary

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]

VERSIONS = ("535.261.03", "550.163.01")
KEY_SONAMES = {"libcuda": "libcuda.so.1", "libnvidia-ml": "libnvidia-ml.so.1",
               "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm": "libnvidia-nvvm.so.4",
               "libcudadebugger": "libcudadebugger.so.1", "libnvidia-cfg": "libnvidia-cfg.so.1",
               "libnvcuvid": "libnvcuvid.so.1", "libnvidia-encode": "libnvidia-encode.so.1",
               "libnvidia-opticalflow": "libnvidia-opticalflow.so.1", "libnvidia-allocator": "libnvidia-allocator.so.1",
               "libEGL_nvidia": "libEGL_nvidia.so.0", "libGLX_nvidia": "libGLX_nvidia.so.0"}
# The firmware Debian ships for each version (firmware-nvidia-gsp): name -> size
FIRMWARE = {"535.261.03": {"gsp_ga10x.bin": 38254112, "gsp_tu10x.bin": 23873824},
            "550.163.01": {"gsp_ga10x.bin": 37340704, "gsp_tu10x.bin": 24618648}}


def debs(version: str) -> Path:
    d = CI_PREFIX / "nvidia-userspace" / version
    if not (d / "SHA256SUMS").is_file():
        missing_component(f"NVIDIA's {version} user-space .debs are not in {d} (bash .ci/install-components fetches them)")
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("usreal")
    return {v: build_from_debs(debs(v), out / "repo") for v in VERSIONS}


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    """Every .deb of each version unpacked by Debian's own dpkg-deb, for an independent reading."""
    dpkg_deb = require_binary("dpkg-deb")
    out = {}
    for v in VERSIONS:
        x = tmp_path_factory.mktemp(f"dpkg-{v}")
        for deb in sorted(debs(v).glob("*.deb")):
            subprocess.run([dpkg_deb, "-x", str(deb), str(x)], check=True)
        out[v] = x
    return out


def _debian_lib_dirs(x: Path) -> list[Path]:
    return [x / "usr/lib/x86_64-linux-gnu/nvidia/current", x / "usr/lib/x86_64-linux-gnu"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_real_libraries_keep_their_versioned_names_and_sonames(built, debian, version):
    m = built[version].manifest
    libs = {lib.path.rpartition("/")[2]: lib.soname for lib in m.libraries}
    assert all(name.endswith(f".so.{version}") for name in libs), libs
    for stem, soname in KEY_SONAMES.items():
        assert libs[f"{stem}.so.{version}"] == soname
    # readelf (binutils) reads the same sonames driverd's reader does
    readelf = shutil.which("readelf")
    if readelf:
        x = debian[version] / "usr/lib/x86_64-linux-gnu/nvidia/current"
        for stem in ("libcuda", "libnvidia-ml", "libnvidia-nvvm"):
            out = subprocess.run([readelf, "-d", str(x / f"{stem}.so.{version}")], capture_output=True, text=True).stdout
            assert f"Library soname: [{KEY_SONAMES[stem]}]" in out
    extra = {"535.261.03": {"libnvidia-vulkan-producer.so.535.261.03": None},     # declares no soname
             "550.163.01": {"libnvidia-gpucomp.so.550.163.01": "libnvidia-gpucomp.so.550.163.01"}}[version]
    for name, soname in extra.items():
        assert libs[name] == soname
    assert len(libs) == 19
    # every library Debian ships of the driver is one of NVIDIA's to driverd (issue 44: nothing else is packed)
    assert not [n for n in built[version].notes if "not one of NVIDIA's" in n], built[version].notes
    assert m.components() == ({"compute": 5, "graphics": 9, "utility": 2, "video": 3} if version.startswith("535")
                              else {"compute": 6, "graphics": 8, "utility": 2, "video": 3})
    assert [b.rpartition("/")[2] for b in m.binaries] == ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
                                                          "nvidia-modprobe", "nvidia-persistenced", "nvidia-smi"]
    assert {f.path.rpartition("/")[2]: f.size for f in m.firmware_files} == FIRMWARE[version]
    assert {f.path for f in m.files if f.path.startswith("share/")} == {
        "share/glvnd/egl_vendor.d/10_nvidia.json", "share/vulkan/icd.d/nvidia_icd.json",
        "share/vulkan/implicit_layer.d/nvidia_layers.json"}
    assert len(m.files) == 29 and len(m.links) == 17
    assert {s.name for s in m.provenance.inputs} >= {"libcuda1", "libnvidia-ml1", "nvidia-smi", "firmware-nvidia-gsp",
                                                      "nvidia-persistenced", "libnvidia-ptxjitcompiler1"}
    ref = built[version].ref
    print(f"{version}: {ref.path.name} {ref.size} bytes, {sum(f.size for f in m.files)} unpacked, "
          f"{len(m.files)} files, {len(m.libraries)} libraries, {len(m.links)} links")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_file_is_debians_byte_for_byte_and_the_links_are_debians(built, debian, version):
    m, x = built[version].manifest, debian[version]
    by_name: dict[str, Path] = {}
    for p in x.rglob("*"):
        rel = p.relative_to(x).as_posix()
        if p.is_file() and not p.is_symlink() and rel.startswith(("usr/lib/x86_64-linux-gnu/", "usr/lib/nvidia/",
                                                                  "usr/bin/", "usr/sbin/", "lib/firmware/",
                                                                  "usr/lib/firmware/", "usr/share/glvnd/",
                                                                  "usr/share/vulkan/")):
            assert p.name not in by_name, f"{p.name} twice in Debian's files"
            by_name[p.name] = p
    for f in m.files:
        name = f.path.rpartition("/")[2]
        src = by_name[name]
        assert hashlib.sha256(src.read_bytes()).hexdigest() == f.sha256, f.path
        assert src.stat().st_size == f.size
    # Debian's symbolic links in its library directories, to the libraries the package holds (less the GBM
    # backend link nvidia-drm_gbm.so, which belongs in a gbm/ directory), are exactly the manifest's links
    names = {lib.path.rpartition("/")[2] for lib in m.libraries}
    theirs = {}
    for d in _debian_lib_dirs(x):
        for p in d.iterdir() if d.is_dir() else []:
            if p.is_symlink() and p.name.startswith("lib") and os.path.basename(os.path.realpath(p)) in names:
                theirs[f"lib64/{p.name}"] = os.readlink(p)
    assert {ln.path: ln.target for ln in m.links} == theirs
    # Debian's nvidia-modprobe is setuid root; the package's is 0755 (and the build says so)
    assert (x / "usr/bin/nvidia-modprobe").stat().st_mode & 0o4000
    assert m.file("bin/nvidia-modprobe").mode == 0o755
    assert any("setuid" in n for n in built[version].notes)


def test_the_same_debs_give_the_same_package(built, tmp_path):
    again = build_from_debs(debs("535.261.03"), tmp_path)
    assert again.ref.sha256 == built["535.261.03"].ref.sha256


def test_a_tampered_library_in_a_real_package_is_refused(built, tmp_path):
    import zstandard
    ref = built["550.163.01"].ref
    raw = bytearray(zstandard.ZstdDecompressor().stream_reader(open(ref.path, "rb")).read())
    with tarfile.open(fileobj=io.BytesIO(bytes(raw))) as t:
        ti = t.getmember("lib64/libnvidia-ml.so.550.163.01")
    raw[ti.offset_data + 4096] ^= 0x01                       # one bit of libnvidia-ml, same size
    bad = tmp_path / ref.path.name
    bad.write_bytes(zstandard.ZstdCompressor(level=1, threads=-1).compress(bytes(raw)))
    with pytest.raises(PackageError) as e:
        verify_package(bad, kind="userspace")
    line = e.value.one_line()
    assert "lib64/libnvidia-ml.so.550.163.01: sha256 is" in line and len(line.splitlines()) == 1
    # against the sha256 a repository index gives, the file is refused before anything is decompressed
    with pytest.raises(PackageError, match="has sha256 .*, expected"):
        ui.install(tmp_path / "h", bad, expected_sha256=ref.sha256)
    assert not (tmp_path / "h").exists()


def test_the_real_user_space_switches_535_to_550_and_rolls_back(built, tmp_path):
    require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    if os.geteuid() != 0:
        missing_component("ldconfig -r ROOT chroots: run as root (CI does)")
    h = tmp_path / "h"
    (h / "etc/ld.so.conf.d").mkdir(parents=True)
    (h / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    root = Root(h)
    a, b = built["535.261.03"], built["550.163.01"]
    ui.install(root, a.ref.path)
    rep = ui.install(root, b.ref.path)
    assert (rep.driver_version, rep.replaced_version) == ("550.163.01", "535.261.03")
    cache = dict(driverfiles.parse_ld_cache((h / "etc/ld.so.cache").read_bytes()))
    assert cache["libcuda.so.1"] == "/var/lib/driverd/driver/current/lib64/libcuda.so.1"
    assert cache["libnvidia-gpucomp.so.550.163.01"].startswith("/var/lib/driverd/driver/current/lib64/")
    inv = driverfiles.inventory(root)
    assert inv.version == "550.163.01" and len(inv.libraries) == 19 and len(inv.firmware) == 2
    tree = h / "var/lib/driverd/driver/550.163.01"
    # the real nvidia-smi finds the tree's libnvidia-ml and asks the (absent) driver; without it, finds none
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([str(tree / "bin/nvidia-smi"), "--version"], capture_output=True, text=True,
                       env={**env, "LD_LIBRARY_PATH": str(tree / "lib64")})
    assert "couldn't communicate with the NVIDIA driver" in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run([str(tree / "bin/nvidia-smi"), "--version"], capture_output=True, text=True, env=env)
    assert "couldn't find libnvidia-ml.so" in r.stdout + r.stderr
    rep = ui.rollback(root)
    assert rep.driver_version == "535.261.03" and driverfiles.find(root).version == "535.261.03"
    cache = dict(driverfiles.parse_ld_cache((h / "etc/ld.so.cache").read_bytes()))
    assert "libnvidia-gpucomp.so.550.163.01" not in cache and "libnvidia-vulkan-producer.so.535.261.03" in cache


def test_a_run_installer_made_with_makeself_from_the_real_files_gives_the_same_user_space(built, debian, tmp_path):
    """NVIDIA's .run cannot be downloaded here: this installer is made with makeself (Debian's `makeself`) from
    Debian's real 550 files laid out the way `--extract-only` lays out NVIDIA's (libraries and binaries at the
    top, firmware/, kernel-open/, 10_nvidia.json, nvidia_icd.json), and extracted with makeself's own
    `--noexec --target` (a stock makeself archive has no NVIDIA `--extract-only` option)."""
    makeself = require_binary("makeself")
    v, x = "550.163.01", debian["550.163.01"]
    name = f"NVIDIA-Linux-x86_64-{v}"
    d = tmp_path / "layout" / name
    (d / "firmware").mkdir(parents=True)
    for lib_dir in _debian_lib_dirs(x):
        for p in lib_dir.iterdir():
            if p.is_file() and not p.is_symlink() and p.name.endswith(f".so.{v}"):
                shutil.copy(p, d / p.name)
    for b in ("usr/lib/nvidia/current/nvidia-smi", "usr/bin/nvidia-persistenced", "usr/bin/nvidia-modprobe",
              "usr/bin/nvidia-cuda-mps-control", "usr/sbin/nvidia-cuda-mps-server"):
        shutil.copy(x / b, d / os.path.basename(b))
    for fw in (x / f"usr/lib/firmware/nvidia/{v}").iterdir():
        shutil.copy(fw, d / "firmware" / fw.name)
    shutil.copy(x / "usr/share/glvnd/egl_vendor.d/10_nvidia.json", d / "10_nvidia.json")
    shutil.copy(x / "usr/share/vulkan/icd.d/nvidia_icd.json", d / "nvidia_icd.json")
    shutil.copy(x / "usr/share/vulkan/implicit_layer.d/nvidia_layers.json", d / "nvidia_layers.json")
    (d / "kernel-open").mkdir()
    (d / "kernel-open/Makefile").write_text("# the open modules' sources would be here\n")
    (d / "nvidia-installer").write_text("#!/bin/sh\necho nvidia-installer stand-in\n")
    os.chmod(d / "nvidia-installer", 0o755)
    run = tmp_path / f"{name}.run"
    subprocess.run([makeself, "--nocomp", "--quiet", str(d), str(run), f"NVIDIA Accelerated Graphics Driver {v}",
                    "./nvidia-installer"], check=True, capture_output=True)
    target = tmp_path / "extracted" / name
    r = subprocess.run(["sh", str(run), "--noexec", "--quiet", "--target", str(target)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = build_from_run_dir(target, tmp_path / "out")
    deb_m, run_m = built[v].manifest, res.manifest
    assert run_m.provenance.source == "nvidia-run" and run_m.driver_version == v
    assert run_m.files == deb_m.files and run_m.libraries == deb_m.libraries and run_m.links == deb_m.links
    assert run_m.binaries == deb_m.binaries
    assert any("kernel-open/" in n for n in res.notes)
