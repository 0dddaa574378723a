"""RPM-based families (RHEL, Fedora, CentOS, SUSE): dracut and the rpm database — what driverd knows
of them so far. Their build dependencies (kernel-devel, /usr/src/kernels/<release>) are not here
yet: a build on such a host gets the default family's hints (docs/architecture.md, "Distributions").

- dracut writes /boot/initramfs-<release>.img (RHEL, Fedora), SUSE /boot/initrd-<release>;
  `dracut -f --kver <release>` rebuilds it.
- rpm: /var/lib/rpm/rpmdb.sqlite (opened read-only and immutable: nothing is written) has a package
  whose file list names the file; a Berkeley-DB rpmdb (/var/lib/rpm/Packages) is not parsed, and a
  module under extra/ (where kmod packages install) is then reported as rpm-owned with that caveat.
"""
from __future__ import annotations

import os
import struct

from driverd.distro.base import Distro, Owned, canon
from driverd.root import Root

RPMTAG_NAME, RPMTAG_VERSION, RPMTAG_RELEASE = 1000, 1001, 1002
RPMTAG_DIRINDEXES, RPMTAG_BASENAMES, RPMTAG_DIRNAMES = 1116, 1117, 1118


def parse_rpm_header(blob: bytes) -> dict[int, object]:
    """The tags driverd needs from an rpm header blob as rpmdb.sqlite stores it (headerExport: il,
    dl, il 16-byte index entries tag/type/offset/count, then the data store; big-endian)."""
    il, dl = struct.unpack_from(">ii", blob, 0)
    if il < 0 or dl < 0 or 8 + il * 16 + dl > len(blob):
        raise ValueError("not an rpm header")
    store = 8 + il * 16
    out: dict[int, object] = {}
    for i in range(il):
        tag, typ, off, cnt = struct.unpack_from(">iiii", blob, 8 + i * 16)
        if tag not in (RPMTAG_NAME, RPMTAG_VERSION, RPMTAG_RELEASE, RPMTAG_DIRINDEXES, RPMTAG_BASENAMES,
                       RPMTAG_DIRNAMES):
            continue
        pos = store + off
        if typ in (6, 9):                                   # STRING, I18NSTRING
            end = blob.index(b"\0", pos)
            out[tag] = blob[pos:end].decode("utf-8", "replace")
        elif typ == 8:                                      # STRING_ARRAY
            vals = []
            for _ in range(cnt):
                end = blob.index(b"\0", pos)
                vals.append(blob[pos:end].decode("utf-8", "replace"))
                pos = end + 1
            out[tag] = vals
        elif typ == 4:                                      # INT32
            out[tag] = list(struct.unpack_from(f">{cnt}i", blob, pos))
    return out


def rpm_owners(root: Root, paths: list[str]) -> tuple[dict[str, tuple[str, str]], str | None]:
    """(path -> (package, version-release), note). Only rpmdb.sqlite is read."""
    real = root.safe_real("/var/lib/rpm/rpmdb.sqlite")
    if real is None or not os.path.isfile(real):
        if root.is_file("/var/lib/rpm/Packages"):
            return {}, "Berkeley-DB rpmdb (/var/lib/rpm/Packages) not parsed"
        return {}, None
    import sqlite3                  # only where an rpmdb exists: its C library costs every other host's start-up
    want = {canon(p): p for p in paths}
    out: dict[str, tuple[str, str]] = {}
    try:
        con = sqlite3.connect(f"file:{real}?mode=ro&immutable=1", uri=True)
        try:
            for (blob,) in con.execute("SELECT blob FROM Packages"):
                try:
                    h = parse_rpm_header(bytes(blob))
                except (ValueError, struct.error):
                    continue
                name = h.get(RPMTAG_NAME)
                if not isinstance(name, str) or "nvidia" not in name:
                    continue
                dirs, bases, idx = h.get(RPMTAG_DIRNAMES) or [], h.get(RPMTAG_BASENAMES) or [], h.get(RPMTAG_DIRINDEXES) or []
                for b, i in zip(bases, idx):
                    if 0 <= i < len(dirs):
                        full = canon(dirs[i] + b)
                        if full in want:
                            out[want[full]] = (name, f"{h.get(RPMTAG_VERSION)}-{h.get(RPMTAG_RELEASE)}")
        finally:
            con.close()
    except sqlite3.Error as e:
        return {}, f"rpmdb.sqlite unreadable ({e.__class__.__name__})"
    return out, None


class Rpm(Distro):
    name = "rpm"
    ids = ("rhel", "fedora", "centos", "suse", "sles", "opensuse")
    manager = "rpm"
    package_title = "RPM package"
    initramfs_tool = "dracut"

    def initramfs_images(self, release: str) -> tuple[str, ...]:
        return (f"/boot/initramfs-{release}.img", f"/boot/initramfs-{release}", f"/boot/initrd-{release}")

    def regenerate_initramfs(self, release: str) -> list[str]:
        return ["dracut", "-f", "--kver", release]

    def package_owners(self, root: Root, paths: list[str]) -> tuple[dict[str, Owned], str | None]:
        rp, note = rpm_owners(root, paths)
        # A package's version is the first one its header gave (the order rpmdb lists them in).
        versions: dict[str, str] = {}
        for pkg, ver in rp.values():
            versions.setdefault(pkg, ver)
        return {p: Owned(pkg, versions[pkg], f"rpmdb.sqlite: {pkg} owns {{file}}") for p, (pkg, _) in rp.items()}, note

    def kernel_images(self, root: Root) -> dict[str, str]:
        """kernel-core installs /lib/modules/<r>/vmlinuz; its %posttrans (kernel-install) copies it to
        /boot/vmlinuz-<r> and writes the boot loader entry. Either names an installed release."""
        out = {rel: f"/lib/modules/{rel}/vmlinuz" for rel in root.listdir("/lib/modules")
               if root.is_file(f"/lib/modules/{rel}/vmlinuz")}
        out.update(super().kernel_images(root))
        return out

    def kernel_install_problems(self, root: Root, release: str) -> list[str]:
        out = []
        if root.is_file(f"/lib/modules/{release}/vmlinuz") and not root.is_file(f"/boot/vmlinuz-{release}"):
            out.append(f"/lib/modules/{release}/vmlinuz has no copy in /boot (the kernel package's %posttrans, "
                       f"kernel-install, did not run or did not finish); fix: kernel-install add {release} "
                       f"/lib/modules/{release}/vmlinuz, or reinstall the kernel-core package of {release}")
        entries = root.listdir("/boot/loader/entries")
        if entries and not any(n.endswith(f"-{release}.conf") or n == f"{release}.conf" for n in entries):
            out.append(f"no boot loader entry for {release} in /boot/loader/entries (kernel-install did not finish); "
                       f"fix: kernel-install add {release} /lib/modules/{release}/vmlinuz")
        return out

    def unread_owner(self, paths: list[str], note: str) -> tuple[tuple[str, ...], str] | None:
        fs = tuple(p for p in paths if "/extra/" in p)
        return (fs, f"{fs[0]} is where kmod packages install; {note}") if fs else None
