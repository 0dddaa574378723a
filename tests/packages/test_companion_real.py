"""A companion package built from a real NVIDIA archive, when one is given: no real archive is reachable from the
machines this suite runs on (NVIDIA's downloads need the network), so this test runs only where one was fetched
beforehand:

    DRIVERD_REAL_COMPANION_ARCHIVE=/path/fabricmanager-linux-x86_64-<version>-archive.tar.xz   (or nscq, nvlsm, imex)
    DRIVERD_REAL_REDISTRIB_JSON=/path/redistrib_<version>.json      (optional: the archive is then checked against it)
    DRIVERD_REAL_DRIVER_VERSION=<version>                           (NVLSM without the JSON: the driver it goes with)

It builds the package twice (the same sha256), verifies it, unpacks it and reads every library's soname and every
binary back from the unpacked files."""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from driverd.build.companion import build_from_archive
from driverd.driver.files import elf_soname
from driverd.package import companion as cp
from driverd.package.archive import unpack, verify_package

ARCHIVE = os.environ.get("DRIVERD_REAL_COMPANION_ARCHIVE")
REDISTRIB = os.environ.get("DRIVERD_REAL_REDISTRIB_JSON")
DRIVER = os.environ.get("DRIVERD_REAL_DRIVER_VERSION")

pytestmark = pytest.mark.skipif(
    not ARCHIVE, reason="no real NVIDIA companion archive is reachable from this machine: set "
    "DRIVERD_REAL_COMPANION_ARCHIVE to a downloaded <component>-linux-<platform>-<version>-archive.tar.xz (and "
    "DRIVERD_REAL_REDISTRIB_JSON to its redistrib_<version>.json) to build from it")


def test_a_real_archive_builds_verifies_and_unpacks(tmp_path):
    archive = Path(ARCHIVE or "")
    res = build_from_archive(archive, tmp_path / "out", redistrib=REDISTRIB, driver=DRIVER)
    m = res.manifest
    print(f"\n{res.ref.path.name}: {len(m.files)} files, {len(m.binaries)} binaries, {len(m.libraries)} libraries, "
          f"{len(m.links)} links, notes: {res.notes}")
    assert m.component in cp.COMPONENTS and m.files and m.binaries + tuple(lib.path for lib in m.libraries)
    assert res.redistrib == (os.path.basename(REDISTRIB) if REDISTRIB else None)
    assert m.provenance.archive.sha256 == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert build_from_archive(archive, tmp_path / "again", redistrib=REDISTRIB, driver=DRIVER).ref.sha256 == res.ref.sha256
    assert verify_package(res.ref.path, res.ref.sha256, res.ref.size, kind="companion") == m
    tree = tmp_path / "tree"
    unpack(res.ref.path, tree, res.ref.sha256, kind="companion")
    for lib in m.libraries:
        assert elf_soname(str(tree / lib.path)) == lib.soname, lib.path
    for b in m.binaries:
        assert stat.S_IMODE((tree / b).stat().st_mode) == 0o755, b
    for ln in m.links:
        assert cp.resolve_link(ln.path, {x.path: x.target for x in m.links}) in {f.path for f in m.files}
