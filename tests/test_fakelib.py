"""driverd.sim.fakelib's shared objects are what the real tools take for libraries: readelf (binutils) reads
their soname from the dynamic section, ldconfig caches them under it, and driverd's own ELF reader agrees."""
from __future__ import annotations

import subprocess

from driverd.driver.files import elf_soname
from driverd.sim.fakelib import LIBRARIES, run_dir, shared_object
from tests.conftest import require_binary


def test_readelf_reads_the_soname(tmp_path):
    readelf = require_binary("readelf")
    f = tmp_path / "libnvidia-ml.so.550.127.05"
    f.write_bytes(shared_object("libnvidia-ml.so.1", note="simulated"))
    r = subprocess.run([readelf, "-d", "-h", "-W", str(f)], capture_output=True, text=True, check=True)
    assert "Library soname: [libnvidia-ml.so.1]" in r.stdout and "DYN (Shared object file)" in r.stdout
    assert r.stderr == "", r.stderr
    assert elf_soname(str(f)) == "libnvidia-ml.so.1"


def test_ldconfig_caches_every_library_of_the_miniature_driver_under_its_soname(tmp_path):
    ldconfig = require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    d = run_dir(tmp_path / "src", "550.127.05")
    root = tmp_path / "root"
    (root / "opt/nv").mkdir(parents=True)
    (root / "etc").mkdir()
    for stem, _ in LIBRARIES:
        (root / "opt/nv" / f"{stem}.so.550.127.05").write_bytes((d / f"{stem}.so.550.127.05").read_bytes())
    (root / "etc/ld.so.conf").write_text("/opt/nv\n")
    # -C/-f name the cache and configuration inside the tree; -n would skip the cache: this writes it
    r = subprocess.run([ldconfig, "-C", str(root / "etc/ld.so.cache"), "-f", str(root / "etc/ld.so.conf"),
                        str(root / "opt/nv")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    p = subprocess.run([ldconfig, "-C", str(root / "etc/ld.so.cache"), "-p"], capture_output=True, text=True,
                       check=True)
    for stem, soname in LIBRARIES:
        want = soname.format(v="550.127.05")
        assert f"\t{want} (libc6,x86-64) => {root}/opt/nv/{want}" in p.stdout, (want, p.stdout)
        if want != f"{stem}.so.550.127.05":                       # ldconfig made the soname link
            assert (root / "opt/nv" / want).is_symlink()
