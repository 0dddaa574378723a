"""Getting nouveau out of the way: blacklist it (modprobe.d), unload it when nothing holds it, say
`reboot_required` when it is in use (typically the console), and tell whether the initramfs still
carries it (then the initramfs must be regenerated with the distro's tool, or nouveau comes back at
boot before the root filesystem and its modprobe.d are even mounted)."""
from __future__ import annotations

import gzip
import lzma
from dataclasses import asdict, field

from driverd import distro
from driverd.datatypes import dataclass
from driverd.host.nouveau import read_nouveau
from driverd.runner import which

BLACKLIST_PATH = "/etc/modprobe.d/driverd-blacklist-nouveau.conf"
BLACKLIST_TEXT = ("# written by driverd: nouveau must not claim NVIDIA GPUs\n"
                  "blacklist nouveau\noptions nouveau modeset=0\n")


@dataclass
class NouveauResult:
    """What getting nouveau out of the way did, and whether a reboot is needed for it."""
    blacklist_written: bool = False
    unloaded: bool = False
    reboot_required: bool = False
    reason: str | None = None
    initramfs: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def write_blacklist(root) -> bool:
    """Idempotent: True when the file was (re)written. Resolved inside the root: a hostile or looping
    /etc/modprobe.d link is a HostPathError, never a write elsewhere."""
    if root.read_text(BLACKLIST_PATH) == BLACKLIST_TEXT:
        return False
    root.atomic_write(BLACKLIST_PATH, BLACKLIST_TEXT, 0o644)
    return True


def remove_blacklist(root) -> bool:
    return root.unlink(BLACKLIST_PATH)


def unload(kernel) -> NouveauResult:
    res = NouveauResult()
    nv = read_nouveau(kernel.root, [])
    if not nv.loaded:
        return res
    m = kernel.modules(["nouveau"]).get("nouveau")
    in_use = m is not None and ((m.refcount or 0) > 0 or m.holders)
    if in_use:
        res.reboot_required = True
        res.reason = (f"nouveau is in use (refcount {m.refcount}, holders {', '.join(m.holders) or 'none'}; "
                      "usually the framebuffer console) and cannot be unloaded; reboot with the blacklist in place")
        return res
    kernel.unload("nouveau")
    res.unloaded = True
    return res


# -- initramfs ---------------------------------------------------------------------------------

def initramfs_image(root, release: str) -> str | None:
    """The image of `release`, under any family's name for it (driverd.distro)."""
    for p in (p for fam in distro.FAMILIES for p in fam.initramfs_images(release)):
        if root.is_file(p):
            return p
    return None


def regenerate_argv(root, os_id: str, id_like: tuple[str, ...], release: str) -> list[str] | None:
    """The command that rebuilds the image: the first family (in driverd.distro's order) whose tool is
    installed or which os-release names."""
    for fam in distro.FAMILIES:
        if which(fam.initramfs_tool, root) or fam.matches(os_id, id_like):
            return fam.regenerate_initramfs(release)
    return None


def cpio_names(data: bytes) -> list[str]:
    """Member names of an initramfs: concatenated newc cpio archives, each possibly compressed
    (uncompressed early-microcode part first, then gzip / xz / zstd)."""
    names: list[str] = []
    pos = 0
    while pos < len(data):
        while pos < len(data) and data[pos] == 0:
            pos += 1
        if pos >= len(data):
            break
        chunk = data[pos:]
        if chunk[:6] in (b"070701", b"070702"):
            pos += _newc(chunk, names)
            continue
        try:
            if chunk[:2] == b"\x1f\x8b":
                plain = gzip.decompress(chunk)
            elif chunk[:6] == b"\xfd7zXZ\x00":
                plain = lzma.decompress(chunk)
            elif chunk[:4] == b"\x28\xb5\x2f\xfd":
                import zstandard
                plain = zstandard.ZstdDecompressor().decompressobj().decompress(chunk)
            else:
                break
        except (OSError, lzma.LZMAError, EOFError, ValueError):
            break
        _newc_all(plain, names)
        break
    return names


def _newc_all(data: bytes, names: list[str]) -> None:
    pos = 0
    while pos < len(data) and data[pos:pos + 6] in (b"070701", b"070702"):
        n = _newc(data[pos:], names)
        if n <= 0:
            break
        pos += n
        while pos < len(data) and data[pos] == 0:
            pos += 1


def _newc(data: bytes, names: list[str]) -> int:
    """Parse one newc archive up to TRAILER!!!; returns bytes consumed."""
    pos = 0
    while data[pos:pos + 6] in (b"070701", b"070702"):
        hdr = data[pos:pos + 110]
        filesize, namesize = int(hdr[54:62], 16), int(hdr[94:102], 16)
        name = data[pos + 110:pos + 110 + namesize - 1].decode(errors="replace")
        pos += (110 + namesize + 3) & ~3
        pos += (filesize + 3) & ~3
        if name == "TRAILER!!!":
            return pos
        names.append(name)
    return pos


def initramfs_report(root, os_id: str, id_like: tuple[str, ...], release: str) -> dict:
    img = initramfs_image(root, release)
    argv = regenerate_argv(root, os_id, id_like, release)
    if img is None:
        return {"image": None, "carries_nouveau": None, "has_blacklist": None, "regenerate": None}
    names = cpio_names(root.read_bytes(img, 1 << 30) or b"")
    carries = any("/nouveau.ko" in n or n.endswith("nouveau.ko.xz") or n.endswith("nouveau.ko.zst") for n in names)
    blacklisted = any(n.endswith(BLACKLIST_PATH.lstrip("/")) for n in names)
    return {"image": img, "carries_nouveau": carries, "has_blacklist": blacklisted,
            "regenerate": argv if carries and not blacklisted else None}
