"""Distribution families (driverd.distro): every family implements the whole interface, os-release
picks the family, and a family added from the test side (an Arch-like one put into the table here,
no production file edited) is used by the initramfs report, the regenerate command and package
ownership — what "a new family is one file" means."""
from __future__ import annotations

import gzip

import pytest

from driverd import distro
from driverd.distro.base import Distro, Owned
from driverd.host.ownership import read_ownership
from driverd.kmod import nouveau
from driverd.root import Root

REL = "6.1.0-47-cloud-amd64"


def test_every_family_implements_the_whole_interface():
    assert [f.name for f in distro.FAMILIES] == ["debian", "rpm"] and distro.DEFAULT.name == "debian"
    for fam in distro.FAMILIES:
        assert isinstance(fam, Distro) and not type(fam).__abstractmethods__
        assert fam.ids and fam.manager and fam.package_title and fam.initramfs_tool
        assert all(p.startswith("/boot/") and REL in p for p in fam.initramfs_images(REL))
        assert REL in fam.regenerate_initramfs(REL)
    # the default family is the one with build knowledge
    d = distro.DEFAULT
    assert d.headers_for(REL) == [f"/usr/src/linux-headers-{REL}"] and d.build_tools_package == "build-essential"


@pytest.mark.parametrize("os_id,id_like,family", [
    ("debian", (), "debian"), ("ubuntu", ("debian",), "debian"), ("linuxmint", ("ubuntu", "debian"), "debian"),
    ("rhel", ("fedora",), "rpm"), ("rocky", ("rhel", "centos", "fedora"), "rpm"), ("opensuse-leap", ("suse", "opensuse"), "rpm"),
    ("arch", (), None), ("unknown", (), None),
])
def test_os_release_picks_the_family(os_id, id_like, family):
    fam = distro.choose(os_id, id_like)
    assert (fam.name if fam else None) == family
    # builds: only a family with build knowledge names its own packages; the others get Debian's (as before)
    assert distro.for_build(os_id, id_like) is distro.DEFAULT


def test_build_hints_come_from_the_family(tmp_path):
    from driverd.errors import PackageError
    from driverd.build.modules import find_headers
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text("ID=rocky\nID_LIKE=\"rhel centos fedora\"\n")
    with pytest.raises(PackageError) as e:
        find_headers(Root(tmp_path), REL)
    assert e.value.fix == f"install linux-headers-{REL} or pass --headers DIR"   # rpm.py has no build knowledge yet
    assert f"/usr/src/linux-headers-{REL}" in e.value.message


class Arch(Distro):
    """A test-side family: mkinitcpio, pacman's local database (desc files with %FILES%)."""
    name = "arch"
    ids = ("arch",)
    manager = "pacman"
    package_title = "Arch package"
    initramfs_tool = "mkinitcpio"

    def initramfs_images(self, release):
        return (f"/boot/initramfs-{release}-arch.img",)

    def regenerate_initramfs(self, release):
        return ["mkinitcpio", "-k", release, "-P"]

    def package_owners(self, root, paths):
        out = {}
        for d in root.listdir("/var/lib/pacman/local"):
            files = (root.read_text(f"/var/lib/pacman/local/{d}/files") or "").splitlines()
            pkg, _, ver = d.partition("-")
            for p in paths:
                if p.lstrip("/") in files:
                    out[p] = Owned(pkg, ver, f"/var/lib/pacman/local/{d}/files names {{file}}")
        return out, None


def test_a_family_added_to_the_table_is_used_everywhere(tmp_path, monkeypatch):
    monkeypatch.setattr(distro, "FAMILIES", (*distro.FAMILIES, Arch()))
    root = tmp_path / "r"
    ko = f"lib/modules/{REL}/extramodules/nvidia.ko"
    for rel, text in {ko: "x", f"lib/modules/{REL}/modules.dep": f"extramodules/nvidia.ko:\n",
                      "var/lib/pacman/local/nvidia-570.195.03/files": f"%FILES%\n{ko}\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    # ownership: its database names the module; it is a package manager's driver, so foreign
    o = read_ownership(Root(root), REL)
    assert o.foreign is not None and o.foreign.manager == "pacman" and o.foreign.package == "nvidia"
    assert o.foreign.version == "570.195.03" and o.foreign.evidence == f"/var/lib/pacman/local/nvidia-570.195.03/files names /{ko}"
    assert o.summary == "Arch package nvidia 570.195.03 (1 file)"
    # initramfs: its image name is looked for, its tool regenerates it when os-release names it
    (root / "boot").mkdir()
    (root / f"boot/initramfs-{REL}-arch.img").write_bytes(gzip.compress(
        _newc([f"usr/lib/modules/{REL}/kernel/drivers/gpu/drm/nouveau/nouveau.ko"])))
    rep = nouveau.initramfs_report(Root(root), "arch", (), REL)
    assert rep["image"] == f"/boot/initramfs-{REL}-arch.img" and rep["carries_nouveau"]
    assert rep["regenerate"] == ["mkinitcpio", "-k", REL, "-P"]
    assert distro.choose("arch", ()).name == "arch"


def _newc(names: list[str]) -> bytes:
    out = b""
    for i, n in enumerate(names + ["TRAILER!!!"]):
        nb = n.encode() + b"\0"
        hdr = b"070701" + b"".join(b"%08X" % v for v in (i, 0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0, len(nb), 0))
        out += hdr + nb + b"\0" * ((-(110 + len(nb))) % 4)
    return out
