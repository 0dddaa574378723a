"""A user-space package holds NVIDIA's files only (issue 44, item 6): libraries by NVIDIA's names with their own
sonames, NVIDIA's binaries, GSP firmware, NVIDIA's ICD files — checked when driverd builds a package and again
when a node installs one, the libraries' sonames read from the unpacked files themselves. PATH links only for
NVIDIA's binaries, only where the name is free on PATH, every one recorded and removed on restore. A .run
directory's firmware/ is never followed out of it.

What NVIDIA ships is read from real data here: Debian's .debs of 535.261.03 and 550.163.01 (every library they
hold, with its DT_SONAME read by binutils' objdump, must be one driverd packs) and NVIDIA's own lists cited in
driverd/package/userspace.py (libnvidia-container's nvc_info.c, nvidia-container-toolkit)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile

import pytest
import zstandard

from driverd.driver import files as driverfiles
from driverd.errors import PackageError
from driverd.package import userspace as us
from driverd.install import userspace as ui
from driverd.driver import userspace as dus
from driverd.build.userspace import build_from_run_dir
from driverd.root import Root
from tests.conftest import CI_PREFIX, missing_component, require_binary
from tests.packages import usfake
from tests.packages.test_userspace_install import host

V = "550.163.01"
UROOT = "/var/lib/driverd/driver"


@pytest.fixture(autouse=True)
def _ldconfig():
    usfake.require_ldconfig()


def so(tmp, soname: str):
    """A real ELF shared object declaring `soname` (gcc -Wl,-soname)."""
    gcc = require_binary("gcc", "cc")
    src = tmp / f"{soname}.c"
    src.write_text(f'const char *driverd_test_lib(void){{return "{soname}";}}\n')
    out = tmp / f"{soname}.built"
    subprocess.run([gcc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    t = tmp_path_factory.mktemp("nvonly")
    return build_from_run_dir(usfake.run_dir(t / "src", V), t / "out")


# -- the builder -------------------------------------------------------------------------------------------

def test_the_builder_never_packs_a_library_that_is_not_nvidias(tmp_path):
    """The issue's libz: a libz.so.<driver version> beside NVIDIA's libraries (its soname libz.so.1) was packed,
    and the loader then gave it to every process on the node. Now it is left out, with a note."""
    d = usfake.run_dir(tmp_path / "src", V)
    shutil.copy(so(tmp_path, "libz.so.1"), d / f"libz.so.{V}")
    res = build_from_run_dir(d, tmp_path / "out")
    names = {lib.path.rpartition("/")[2] for lib in res.manifest.libraries}
    assert f"libz.so.{V}" not in names and f"libcuda.so.{V}" in names
    assert not [ln for ln in res.manifest.links if "libz" in ln.path]
    assert any(n.startswith(f"left out lib64/libz.so.{V}") and "not one of NVIDIA's libraries" in n
               for n in res.notes), res.notes
    # installed, the loader's cache has no libz of driverd's
    root = host(tmp_path / "h")
    ui.install(root, res.ref.path)
    cache = driverfiles.parse_ld_cache((tmp_path / "h/etc/ld.so.cache").read_bytes())
    assert not [p for k, p in cache if k.startswith("libz.so")], cache


def test_a_library_of_nvidias_name_declaring_another_libraries_soname_fails_the_build(tmp_path):
    d = usfake.run_dir(tmp_path / "src", V)
    shutil.copy(so(tmp_path, "libz.so.1"), d / f"libnvidia-cfg.so.{V}")
    with pytest.raises(PackageError) as e:
        build_from_run_dir(d, tmp_path / "out")
    line = e.value.one_line()
    assert f"libnvidia-cfg.so.{V} declares the soname libz.so.1, not one of libnvidia-cfg's" in line, line
    assert "\n" not in line
    assert not list(tmp_path.glob("out/*.tar.zst"))


def test_a_run_directorys_firmware_link_is_not_followed_out_of_it(tmp_path):
    d = usfake.run_dir(tmp_path / "src", V)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "gsp_ga10x.bin").write_bytes(b"not from the .run\n")
    shutil.rmtree(d / "firmware")
    os.symlink(outside, d / "firmware")
    res = build_from_run_dir(d, tmp_path / "out")
    assert not res.manifest.firmware_files
    assert any(n.startswith(f"firmware/ leads out of {d}") for n in res.notes), res.notes
    # a link that stays inside the directory is followed
    os.unlink(d / "firmware")
    (d / "fw-real").mkdir()
    (d / "fw-real/gsp_ga10x.bin").write_bytes(b"gsp\n" * 16)
    os.symlink("fw-real", d / "firmware")
    res = build_from_run_dir(d, tmp_path / "out2")
    assert [f.path for f in res.manifest.firmware_files] == [f"firmware/nvidia/{V}/gsp_ga10x.bin"]


# -- the install: a package made elsewhere -----------------------------------------------------------------

def forge(good_path, out, *, add: dict[str, tuple[bytes, int]] = (), manifest=None):
    """`good_path` with files added (path -> (bytes, mode)) and its manifest edited by `manifest(dict)`: what an
    attacker's tool (not driverd's builder, which refuses these) can write. The archive stays well-formed."""
    add = dict(add)
    src = tarfile.open(fileobj=io.BytesIO(zstandard.ZstdDecompressor().stream_reader(open(good_path, "rb")).read()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for ti in src.getmembers():
            data = src.extractfile(ti).read() if ti.isreg() else None
            if ti.name == "manifest.json":
                d = json.loads(data)
                for path, (blob, mode) in add.items():
                    d["files"].append({"path": path, "size": len(blob), "mode": mode,
                                       "sha256": hashlib.sha256(blob).hexdigest()})
                if manifest:
                    manifest(d)
                data = json.dumps(d).encode()
                ti.size = len(data)
            dst.addfile(ti, io.BytesIO(data) if data is not None else None)
        for path, (blob, mode) in add.items():
            ti = tarfile.TarInfo(path)
            ti.size, ti.mode = len(blob), mode
            dst.addfile(ti, io.BytesIO(blob))
    out.write_bytes(zstandard.ZstdCompressor(level=1).compress(buf.getvalue()))
    return out


@pytest.mark.parametrize("case,words", [
    ("sudo", "binary bin/sudo is not one of NVIDIA's driver binaries"),
    ("libz", f"libz.so.{V} is not one of NVIDIA's libraries"),
    ("stray", "lib64/libz.so.1 is in lib64/ but not listed as a library"),
    ("forged-soname", f"lib64/libnvidia-cfg.so.{V} declares the soname libz.so.1, its manifest says libnvidia-cfg.so.1"),
    ("foreign-link", "link lib64/libz.so.1 -> libcuda.so.1 is neither the soname nor the development link"),
    ("firmware", f"firmware firmware/nvidia/{V}/run.sh is not NVIDIA's GSP firmware"),
])
def test_a_package_that_is_not_nvidias_files_is_refused_at_install(tmp_path, good, case, words):
    """One listing bin/sudo made /usr/local/bin/sudo first on root's PATH; one holding a library that declares
    libz.so.1 made the loader give it to every process. Refused before anything is installed, one line."""
    z = so(tmp_path, "libz.so.1").read_bytes()
    if case == "sudo":
        p = forge(good.ref.path, tmp_path / "p.tar.zst", add={"bin/sudo": (b"#!/bin/sh\nid\n", 0o755)},
                  manifest=lambda d: d["binaries"].append("bin/sudo"))
    elif case == "libz":
        p = forge(good.ref.path, tmp_path / "p.tar.zst", add={f"lib64/libz.so.{V}": (z, 0o644)},
                  manifest=lambda d: (d["libraries"].append({"path": f"lib64/libz.so.{V}", "soname": "libz.so.1",
                                                             "component": "other"}),
                                      d["links"].append({"path": "lib64/libz.so.1", "target": f"libz.so.{V}"})))
    elif case == "stray":
        p = forge(good.ref.path, tmp_path / "p.tar.zst", add={"lib64/libz.so.1": (z, 0o644)})
    elif case == "forged-soname":
        p = forge(good.ref.path, tmp_path / "p.tar.zst", add={f"lib64/libnvidia-cfg.so.{V}": (z, 0o644)},
                  manifest=lambda d: (d["libraries"].append({"path": f"lib64/libnvidia-cfg.so.{V}",
                                                             "soname": "libnvidia-cfg.so.1", "component": "utility"}),
                                      d["links"].append({"path": "lib64/libnvidia-cfg.so.1",
                                                         "target": f"libnvidia-cfg.so.{V}"})))
    elif case == "foreign-link":
        p = forge(good.ref.path, tmp_path / "p.tar.zst",
                  manifest=lambda d: d["links"].append({"path": "lib64/libz.so.1", "target": "libcuda.so.1"}))
    else:
        p = forge(good.ref.path, tmp_path / "p.tar.zst", add={f"firmware/nvidia/{V}/run.sh": (b"#!/bin/sh\n", 0o644)})
    root = host(tmp_path / "h")
    with pytest.raises(PackageError) as e:
        ui.install(root, p)
    line = e.value.one_line()
    assert words in line and "\n" not in line, line
    h = tmp_path / "h"
    assert not os.path.lexists(h / "usr/local/bin/sudo") and dus.current(root) is None
    assert not (h / "etc/ld.so.conf.d/00-driverd-nvidia.conf").exists()
    assert not list((h / UROOT.lstrip("/")).glob("[0-9]*"))            # no tree of it either


# -- PATH links ---------------------------------------------------------------------------------------------

def test_a_path_link_is_made_only_where_the_name_is_free_on_path(tmp_path, good):
    """The host's own nvidia-modprobe in /usr/bin (Debian's, setuid) is never shadowed by a link in
    /usr/local/bin, nor is a link made that a file earlier on PATH would hide."""
    root = host(tmp_path / "h")
    h = tmp_path / "h"
    for hp in ("usr/bin/nvidia-modprobe", "usr/local/sbin/nvidia-debugdump"):
        (h / hp).parent.mkdir(parents=True, exist_ok=True)
        (h / hp).write_text("#!/bin/sh\necho the host's\n")
    rep = ui.install(root, good.ref.path)
    assert not os.path.lexists(h / "usr/local/bin/nvidia-modprobe")
    assert not os.path.lexists(h / "usr/local/bin/nvidia-debugdump")
    assert os.readlink(h / "usr/local/bin/nvidia-smi") == f"{UROOT}/current/bin/nvidia-smi"
    assert any(n.startswith("/usr/local/bin/nvidia-modprobe is not linked: /usr/bin/nvidia-modprobe is on PATH")
               for n in rep.notes), rep.notes
    assert any("/usr/local/sbin/nvidia-debugdump is on PATH" in n for n in rep.notes), rep.notes
    assert ui.is_installed(root, good.ref.sha256)             # stable: the next pass changes nothing
    rep = ui.install(root, good.ref.path)
    assert not rep.changed


def test_every_link_made_is_recorded_and_every_one_is_removed_on_restore(tmp_path, good):
    root = host(tmp_path / "h")
    h = tmp_path / "h"
    ui.install(root, good.ref.path)
    rec = json.loads((h / "var/lib/driverd/userspace/links.json").read_text())
    made = sorted(n for n in os.listdir(h / "usr/local/bin")
                  if os.readlink(h / "usr/local/bin" / n) == f"{UROOT}/current/bin/{n}")
    assert rec == {"bin_dir": "/usr/local/bin", "links": made} and "nvidia-smi" in made
    # a link an older driverd made for a name that is not NVIDIA's (the bin/sudo), still there
    os.symlink(f"{UROOT}/current/bin/sudo", h / "usr/local/bin/sudo")
    assert not ui.is_installed(root, good.ref.sha256)         # not what the tree wants: made right again
    ui.install(root, good.ref.path)
    assert not os.path.lexists(h / "usr/local/bin/sudo")
    os.symlink(f"{UROOT}/current/bin/sudo", h / "usr/local/bin/sudo")
    ui.restore(root, None)
    assert os.listdir(h / "usr/local/bin") == []
    assert json.loads((h / "var/lib/driverd/userspace/links.json").read_text())["links"] == []


# -- what NVIDIA ships, from real data ----------------------------------------------------------------------

@pytest.mark.parametrize("version", ["535.261.03", "550.163.01"])
def test_every_library_debian_ships_of_nvidias_is_one_driverd_packs(tmp_path, version):
    """The allowed names are not tuned to the fixtures: every library file of the driver version in Debian's
    .debs, with the soname binutils reads from it, passes; and the check refuses the same file under a
    foreign soname."""
    debs = CI_PREFIX / "nvidia-userspace" / version
    if not (debs / "SHA256SUMS").is_file():
        missing_component(f"NVIDIA's {version} user-space .debs are not in {debs} (bash .ci/install-components)")
    dpkg_deb, objdump = require_binary("dpkg-deb"), require_binary("objdump")
    x = tmp_path / "x"
    for deb in sorted(debs.glob("*.deb")):
        if deb.name.startswith(("lib", "nvidia-egl", "nvidia-vulkan")):
            subprocess.run([dpkg_deb, "-x", str(deb), str(x)], check=True)
    seen = {}
    for p in x.rglob(f"*.so.{version}"):
        if p.is_file() and not p.is_symlink():
            out = subprocess.run([objdump, "-p", str(p)], capture_output=True, text=True, check=True).stdout
            soname = next((ln.split()[1] for ln in out.splitlines() if ln.split()[:1] == ["SONAME"]), None)
            seen[p.name] = soname
    assert len(seen) >= 18, seen
    assert {n: us.library_problem(n, s, version) for n, s in seen.items() if us.library_problem(n, s, version)} == {}
    assert us.library_problem(f"libcuda.so.{version}", "libz.so.1", version)
    assert us.library_problem(f"libz.so.{version}", "libz.so.1", version)
