"""What a kernel module file declares, read in one place for the whole of driverd (packages and the
module lifecycle alike):

- `read_modinfo`: the NUL-separated key=value strings of the file's ELF `.modinfo` section (version,
  license, vermagic, depends, firmware, parm/parmtype) and whether a signature is appended, read
  the way the kernel itself reads them at load time, so the simulated kernel and the validation
  before a real load judge the same bytes;
- `parse_modinfo` / `modinfo` / `modinfo_tool`: kmod's own `modinfo` output, for what only it
  decodes (the PKCS#7 signer), one run for many files."""
from __future__ import annotations

import lzma
import os
import struct
from dataclasses import dataclass, field
from typing import Sequence

from driverd.errors import CommandError, ModuleError, PackageError
from driverd.runner import Runner, which

SIG_MAGIC = b"~Module signature appended~\n"
OPEN_LICENSES = ("Dual MIT/GPL", "GPL", "Dual BSD/GPL", "GPL v2")


@dataclass(frozen=True)
class Param:
    name: str
    type: str | None          # int, uint, bool, charp, "array of int", ... (None when undeclared)
    description: str = ""


@dataclass(frozen=True)
class ModInfo:
    path: str
    name: str | None
    version: str | None
    license: str | None
    vermagic: str | None
    depends: tuple[str, ...]
    firmware: tuple[str, ...]
    params: dict[str, Param] = field(default_factory=dict)
    signed: bool = False
    signer: str | None = None
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
        try:
            return zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except zstandard.ZstdError as e:
            raise ValueError(f"damaged zstd data ({e})") from None
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


def from_fields(path: str, fields: list[tuple[str, str]], signed: bool, signer: str | None = None) -> ModInfo:
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
                   firmware=tuple(firmware), params=params, signed=signed, signer=signer, fields=tuple(fields))


class NotAModule(ModuleError, ValueError):
    """A file that is not a (readable) kernel module: driverd's own error type, one line, and a
    ValueError as read_modinfo always raised."""


def read_modinfo(path: str | os.PathLike) -> ModInfo:
    """Parse a module file. Raises NotAModule (a ValueError) for a file that is not a kernel module."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        raw = f.read()
    try:
        data = _decompress(p, raw)
        signed = data.endswith(SIG_MAGIC)
        return from_fields(p, parse_fields(modinfo_section(data)), signed)
    except (ValueError, IndexError, OverflowError, struct.error, EOFError, lzma.LZMAError, OSError) as e:
        # A truncated or inconsistent ELF header made the section walk index past the data (found by
        # fuzzing: IndexError, struct.error), or the compression is damaged.
        raise NotAModule(f"{p} is not a readable kernel module: {' '.join(str(e).split())[:200]}",
                         fix="rebuild or re-fetch the module's package") from None


def parse_tool_output(path: str, text: str) -> ModInfo:
    """`modinfo FILE` output into a ModInfo (the tool's format is parsed in one place: parse_modinfo)."""
    rec = (parse_modinfo(text) or [{}])[0]
    fields: list[tuple[str, str]] = []
    for k, values in rec.items():
        for v in values:
            if k == "parm":   # 'NAME:description (type)'
                n, _, rest = v.partition(":")
                typ = None
                if rest.endswith(")") and "(" in rest:
                    rest, _, typ = rest[:-1].rpartition("(")
                    rest = rest.rstrip()
                fields.append(("parm", f"{n}:{rest}"))
                if typ:
                    fields.append(("parmtype", f"{n}:{typ}"))
            elif k not in ("filename", "sig_id", "sig_key", "signature", "signer", "sig_hashalgo"):
                fields.append((k, v))
    signer = (rec.get("signer") or [None])[0]
    signed = any(k in rec for k in ("sig_id", "sig_key", "signature", "signer"))
    return from_fields(path, fields, signed, signer)


def modinfo_tool(runner, path: str) -> ModInfo | None:
    """kmod's `modinfo FILE`, or None when the tool is missing (callers fall back to read_modinfo)."""
    exe = which("modinfo")
    if exe is None:
        return None
    try:
        res = runner.run([exe, path], timeout=30, check=False, mutates=False)
    except CommandError:
        return None
    if res.returncode != 0:
        return None
    return parse_tool_output(path, res.stdout)


# -- kmod's modinfo tool --------------------------------------------------------------------------
SINGLE_FIELDS = ("name", "version", "vermagic", "srcversion", "signer", "sig_key", "sig_hashalgo")


def parse_modinfo(text: str) -> list[dict[str, list[str]]]:
    """Split `modinfo a.ko b.ko` output into one dict per file: field -> values (in order).

    Continuation lines (the signature's hex dump) start with a tab and belong to the previous field.
    """
    out: list[dict[str, list[str]]] = []
    cur: dict[str, list[str]] | None = None
    last: str | None = None
    for line in text.splitlines():
        if line.startswith(("\t", " ")) and cur is not None and last is not None:
            cur[last][-1] += line.strip()
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "filename":
            cur = {}
            out.append(cur)
        if cur is None:
            cur = {}
            out.append(cur)
        cur.setdefault(key, []).append(value)
        last = key
    return out


def modinfo(paths: Sequence[str | os.PathLike], runner: Runner | None = None) -> dict[str, dict[str, list[str]]]:
    """filename -> fields for every module, from one `modinfo` run."""
    runner = runner or Runner()
    exe = which("modinfo")
    if exe is None:
        raise PackageError("modinfo is not installed", cause="kmod is missing", fix="install kmod")
    if not paths:
        return {}
    res = runner.run([exe, *map(os.fspath, paths)], timeout=60, check=False, mutates=False)
    if not res.ok:
        raise PackageError(f"modinfo could not read a module: {res.first_error_line()}",
                           cause="a .ko file is damaged or not a kernel module", fix="rebuild the package")
    parsed = parse_modinfo(res.stdout)
    return {os.path.realpath(p["filename"][0]): p for p in parsed if p.get("filename")}


def first(fields: dict[str, list[str]], key: str) -> str | None:
    v = fields.get(key)
    return v[0] if v else None


def module_name_from_file(path: str | os.PathLike) -> str:
    return module_name(os.fspath(path))
