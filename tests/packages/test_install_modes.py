"""Install writes safe modes whatever the archive says: files 0644, directories 0755, owned by the
installing user (root on a node). A package whose members carry unusual modes (world-writable,
executable) is installed (setuid bits are refused outright by the manifest check) with safe ones and the modes are reported, not obeyed."""
from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from driverd.install import modules as inst
from driverd.package.archive import pack, unpack, unusual_modes, verify_package
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, write_host

REL = "6.1.0-47-cloud-amd64"
pytestmark = pytest.mark.real


@pytest.fixture
def odd_package(tmp_path):
    ref = make_fake_package(tmp_path / "src", "550.127.05", REL)
    stage = tmp_path / "stage"
    unpack(ref.path, stage)
    odd = {"modules/nvidia.ko": 0o666, "modules/nvidia-uvm.ko": 0o775}
    for path, mode in odd.items():
        os.chmod(stage / path, mode)
    files = tuple(dataclasses.replace(f, mode=odd.get(f.path, f.mode)) for f in ref.manifest.files)
    m = dataclasses.replace(ref.manifest, files=files)
    out = pack(stage, m, tmp_path / "out")
    return out


def _modes(d) -> dict[str, int]:
    return {str(p.relative_to(d)): stat.S_IMODE(p.stat().st_mode) for p in [d, *d.rglob("*")] if not p.is_symlink()}


def test_unusual_modes_are_reported_and_not_obeyed(tmp_path, odd_package, kmod_tools):
    m = verify_package(odd_package.path)                  # consistent with its manifest: not refused
    assert sorted(unusual_modes(m)) == ["modules/nvidia-uvm.ko has mode 0775 in the package (installed 0644)",
                                        "modules/nvidia.ko has mode 0666 in the package (installed 0644)"]
    host = write_host(tmp_path / "host", HostSpec(release=REL))
    old = os.umask(0)                                     # not even a permissive umask leaks through
    try:
        rep = inst.install(Root(str(host)), odd_package.path, Runner())
    finally:
        os.umask(old)
    assert any("nvidia.ko has mode 0666" in n for n in rep.notes)
    mdir = host / f"lib/modules/{REL}/updates/driverd"
    for name, mode in _modes(mdir).items():
        assert mode == (0o755 if (mdir / name).is_dir() else 0o644), (name, oct(mode))
    fw = host / "lib/firmware/nvidia/550.127.05"
    for name, mode in _modes(fw).items():
        assert mode == (0o755 if (fw / name).is_dir() else 0o644), (name, oct(mode))
    for p in [mdir, *mdir.iterdir()]:
        assert p.stat().st_uid == os.geteuid()
    kept = host / "var/lib/driverd/packages/kept"
    for p in kept.rglob("*.ko"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_unpack_writes_safe_modes(tmp_path, odd_package):
    d = tmp_path / "u"
    unpack(odd_package.path, d)
    assert {n: oct(m) for n, m in _modes(d).items() if not (d / n).is_dir()} == \
        {n: "0o644" for n, m in _modes(d).items() if not (d / n).is_dir()}
    assert all(m == 0o755 for n, m in _modes(d).items() if (d / n).is_dir() and n != ".")
