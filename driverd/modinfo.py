"""What a kernel module file declares, read in one place for the whole of driverd (packages and the
module lifecycle alike), from the file itself — no kmod, no subprocess, so it works in a minimal
container and on a host without kmod installed:

- `read_modinfo`: the NUL-separated key=value strings of the file's ELF `.modinfo` section (version,
  license, vermagic, depends, firmware, parm/parmtype) and whether a signature is appended, read
  the way the kernel itself reads them at load time, so the simulated kernel and the validation
  before a real load judge the same bytes;
- `module_bytes`: the module's ELF image, decompressed (.ko.xz, .ko.zst, .ko.gz).

Who signed a module (the PKCS#7 signer) is decoded by driverd.package.modsig; the two are combined
into kmod's `modinfo` fields by driverd.package.modfields."""
from __future__ import annotations

import lzma
import os
import struct
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.errors import ModuleError

SIG_MAGIC = b"~Module signature appended~\n"
OPEN_LICENSES = ("Dual MIT/GPL", "GPL", "Dual BSD/GPL", "GPL v2")


@dataclass(frozen=True)
class Param:
    """One parameter a kernel module declares in its .modinfo section."""
    name: str
    type: str | None          # int, uint, bool, charp, "array of int", ... (None when undeclared)
    description: str = ""


@dataclass(frozen=True)
class ModInfo:
    """What one kernel module file declares in its .modinfo section, and whether it is signed."""
    path: str
    name: str | None
    version: str | None
    license: str | None
    vermagic: str | None
    depends: tuple[str, ...]
    firmware: tuple[str, ...]
    params: dict[str, Param] = field(default_factory=dict)
    signed: bool = False
    fields: tuple[tuple[str, str], ...] = ()

    @property
    def vermagic_release(self) -> str | None:
        return self.vermagic.split()[0] if self.vermagic else None

    @property
    def flavor(self) -> str:
        """NVIDIA's open modules are Dual MIT/GPL; the proprietary ones declare license NVIDIA."""
        return "open" if (self.license or "") in OPEN_LICENSES else "proprietary"


def module_name(path: str) -> str:
    """The kernel's name for a module file: basename without .ko[.xz|.zst|.gz], '-' -> '_'."""
    base = os.path.basename(path)
    for ext in (".xz", ".zst", ".gz"):
        base = base.removesuffix(ext)
    return base.removesuffix(".ko").replace("-", "_")


def _decompress(path: str, data: bytes) -> bytes:
    if path.endswith(".xz"):
        return lzma.decompress(data)
    if path.endswith(".zst"):
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    if path.endswith(".gz"):
        import gzip
        return gzip.decompress(data)
    return data


def modinfo_section(data: bytes) -> bytes:
    """Contents of the `.modinfo` section of an ELF relocatable object (32/64-bit, either endianness)."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    is64 = data[4] == 2
    end = "<" if data[5] == 1 else ">"
    if is64:
        shoff, = struct.unpack_from(end + "Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x3A)
    else:
        shoff, = struct.unpack_from(end + "I", data, 0x20)
        shentsize, shnum, shstrndx = struct.unpack_from(end + "HHH", data, 0x2E)

    def section(i: int) -> tuple[int, int, int]:
        off = shoff + i * shentsize
        if is64:
            name, _t, _f, _a, offset, size = struct.unpack_from(end + "IIQQQQ", data, off)
        else:
            name, _t, _f, _a, offset, size = struct.unpack_from(end + "IIIIII", data, off)
        return name, offset, size

    _, str_off, str_size = section(shstrndx)
    names = data[str_off:str_off + str_size]
    for i in range(shnum):
        name, offset, size = section(i)
        sname = names[name:names.index(b"\0", name)]
        if sname == b".modinfo":
            return data[offset:offset + size]
    raise ValueError("no .modinfo section (not a kernel module)")


def parse_fields(raw: bytes) -> list[tuple[str, str]]:
    out = []
    for chunk in raw.split(b"\0"):
        if b"=" in chunk:
            k, _, v = chunk.decode("utf-8", errors="replace").partition("=")
            out.append((k, v))
    return out


def from_fields(path: str, fields: list[tuple[str, str]], signed: bool) -> ModInfo:
    one: dict[str, str] = {}
    firmware: list[str] = []
    descs: dict[str, str] = {}
    types: dict[str, str] = {}
    for k, v in fields:
        if k == "firmware":
            firmware.append(v)
        elif k == "parm":
            n, _, d = v.partition(":")
            descs[n] = d
        elif k == "parmtype":
            n, _, t = v.partition(":")
            types[n] = t
        else:
            one.setdefault(k, v)
    params = {n: Param(n, types.get(n), descs.get(n, "")) for n in list(types) + [d for d in descs if d not in types]}
    deps = tuple(d.replace("-", "_") for d in one.get("depends", "").split(",") if d)
    return ModInfo(path=path, name=one.get("name") or module_name(path), version=one.get("version"),
                   license=one.get("license"), vermagic=one.get("vermagic"), depends=deps,
                   firmware=tuple(firmware), params=params, signed=signed, fields=tuple(fields))


def module_bytes(path: str | os.PathLike) -> bytes:
    """The ELF image of a module file, decompressed. Raises OSError (unreadable) or ValueError (a
    compressed file that does not decompress)."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        raw = f.read()
    try:
        return _decompress(p, raw)
    except Exception as e:            # noqa: BLE001 - lzma, gzip and zstandard each raise their own types
        raise ValueError(f"cannot decompress {os.path.basename(p)} ({e.__class__.__name__}: {e})") from None


def modinfo_of_bytes(path: str, data: bytes) -> ModInfo:
    """Parse a decompressed module image. Raises ValueError for bytes that are not a kernel module."""
    try:
        section = modinfo_section(data)
    except (struct.error, IndexError, OverflowError):
        # a truncated or inconsistent ELF header sends the section walk past the data (found by fuzzing)
        raise ValueError("truncated or inconsistent ELF headers") from None
    return from_fields(path, parse_fields(section), data.endswith(SIG_MAGIC))


class NotAModule(ModuleError, ValueError):
    """A file that is not a (readable) kernel module: driverd's own error type, one line, and a
    ValueError as read_modinfo always raised."""


def read_modinfo(path: str | os.PathLike) -> ModInfo:
    """Parse a module file. Raises NotAModule (a ValueError) for a file that is not a kernel module."""
    p = os.fspath(path)
    try:
        return modinfo_of_bytes(p, module_bytes(p))
    except (ValueError, IndexError, OverflowError, struct.error, EOFError, lzma.LZMAError, OSError) as e:
        # A truncated or inconsistent ELF header made the section walk index past the data (found by
        # fuzzing: IndexError, struct.error), or the compression is damaged.
        raise NotAModule(f"{p} is not a readable kernel module: {' '.join(str(e).split())[:200]}",
                         fix="rebuild or re-fetch the module's package") from None


def vermagic_of(path: str | os.PathLike) -> str | None:
    """A module file's vermagic, reading only its ELF headers and .modinfo section (a mapping of the file: a
    60 MB nvidia.ko costs a few pages, not a read). Compressed modules are decompressed. Raises NotAModule."""
    import mmap
    p = os.fspath(path)
    try:
        if p.endswith((".xz", ".zst", ".gz")):
            section = modinfo_section(module_bytes(p))
        else:
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                section = bytes(modinfo_section(mm))
    except (ValueError, IndexError, OverflowError, struct.error, EOFError, lzma.LZMAError, OSError) as e:
        raise NotAModule(f"{p} is not a readable kernel module: {' '.join(str(e).split())[:200]}",
                         fix="rebuild or re-fetch the module's package") from None
    return next((v for k, v in parse_fields(section) if k == "vermagic"), None)


def module_name_from_file(path: str | os.PathLike) -> str:
    return module_name(os.fspath(path))
