"""Small but real kernel-module files (ELF64 relocatable `.ko`) written in pure Python.

The real kmod tools accept them: `modinfo` reads the `.modinfo` section (and an appended signature),
`depmod` reads exported symbols from `__ksymtab_strings` and imported ones as undefined entries of
`.symtab`, and computes `modules.dep` from them — so `nvidia_uvm` depends on `nvidia` because it
references a symbol that `nvidia` exports, exactly as with a compiled module. Optionally each file is
signed with the kernel's own `scripts/sign-file`, so `modinfo` reports signer/sig_key/sig_hashalgo.

Tests, the demo and the fleet benchmark use these instead of a 2-minute NVIDIA compile. The files
cannot be loaded into a kernel (there is no code), which nothing here ever tries.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass

EM_BY_ARCH = {"x86_64": 62, "aarch64": 183}
ET_REL = 1
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB = 1, 2, 3
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 0x1, 0x2, 0x4
STB_LOCAL, STB_GLOBAL = 0, 1
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_SECTION = 0, 1, 2, 3
SHN_UNDEF = 0
# struct module is large; its name[] field sits after `state` (4 bytes, padded) and `list` (two
# pointers). The size only matters to a loader, which never sees these files.
THIS_MODULE_SIZE = 0x380
THIS_MODULE_NAME_OFFSET = 24
MODULE_NAME_LEN = 56

DEFAULT_VERSION = "535.261.03"
DEFAULT_RELEASE = "6.1.0-47-cloud-amd64"


def default_vermagic(release: str) -> str:
    """The vermagic string a Debian kernel of `release` expects (SMP preempt, unload, modversions)."""
    return f"{release} SMP preempt mod_unload modversions "


@dataclass
class FakeModule:
    """One fake kernel module to write as a real ELF `.ko`: its modinfo fields and the symbols it links by."""
    name: str                                       # module name as the kernel sees it (underscores)
    version: str = DEFAULT_VERSION
    vermagic: str = default_vermagic(DEFAULT_RELEASE)
    srcversion: str = ""                            # default: derived from name+version
    depends: tuple[str, ...] = ()                   # the modinfo depends= field (depmod uses symbols)
    exports: tuple[str, ...] = ()                   # symbols this module exports
    imports: tuple[str, ...] = ()                   # symbols it needs from other modules / the kernel
    license: str = "Dual MIT/GPL"
    description: str = ""
    params: tuple[tuple[str, str, str], ...] = ()   # (name, type, description)
    firmware: tuple[str, ...] = ()
    extra_modinfo: tuple[tuple[str, str], ...] = ()
    text_size: int = 64                             # bytes of (zero) code; pads the file for size tests

    @property
    def filename(self) -> str:
        # Kernel modules names use '_' but NVIDIA's files use '-': nvidia_uvm lives in nvidia-uvm.ko.
        return self.name.replace("_", "-") + ".ko"

    def modinfo_entries(self) -> list[tuple[str, str]]:
        import hashlib
        src = self.srcversion or hashlib.sha256(f"{self.name}:{self.version}".encode()).hexdigest()[:23].upper()
        out: list[tuple[str, str]] = [("version", self.version), ("license", self.license)]
        if self.description:
            out.append(("description", self.description))
        for fw in self.firmware:
            out.append(("firmware", fw))
        for pname, ptype, pdesc in self.params:
            out.append(("parm", f"{pname}:{pdesc}"))
            out.append(("parmtype", f"{pname}:{ptype}"))
        out.extend(self.extra_modinfo)
        out += [("srcversion", src), ("depends", ",".join(self.depends)), ("retpoline", "Y"),
                ("name", self.name), ("vermagic", self.vermagic)]
        return out


class _StrTab:
    def __init__(self) -> None:
        self.data = bytearray(b"\0")
        self.index: dict[str, int] = {"": 0}

    def add(self, s: str) -> int:
        if s not in self.index:
            self.index[s] = len(self.data)
            self.data += s.encode() + b"\0"
        return self.index[s]


def _filler(seed: str, n: int) -> bytes:
    """Deterministic, incompressible bytes standing in for machine code (so package sizes are real)."""
    import hashlib
    out = bytearray()
    i = 0
    while len(out) < n:
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest()
        i += 1
    return bytes(out[:n])


def elf_bytes(mod: FakeModule, arch: str = "x86_64") -> bytes:
    """The bytes of a relocatable ELF64 little-endian object that kmod reads as a kernel module."""
    if arch not in EM_BY_ARCH:
        raise ValueError(f"unsupported arch {arch!r}")
    modinfo = b"".join(f"{k}={v}".encode() + b"\0" for k, v in mod.modinfo_entries())
    this_module = bytearray(THIS_MODULE_SIZE)
    nm = mod.name.encode()[:MODULE_NAME_LEN - 1]
    this_module[THIS_MODULE_NAME_OFFSET:THIS_MODULE_NAME_OFFSET + len(nm)] = nm
    text = _filler(mod.name, max(mod.text_size, len(mod.exports) * 16, 16))
    ksymstr = b"".join(e.encode() + b"\0" for e in mod.exports)

    # Sections: (name, type, flags, data, align, entsize)
    sections: list[tuple[str, int, int, bytes, int, int]] = [
        (".text", SHT_PROGBITS, SHF_ALLOC | SHF_EXECINSTR, text, 16, 0),
        (".modinfo", SHT_PROGBITS, SHF_ALLOC, modinfo, 1, 0),
        (".gnu.linkonce.this_module", SHT_PROGBITS, SHF_ALLOC | SHF_WRITE, bytes(this_module), 64, 0),
    ]
    if mod.exports:
        sections.append(("__ksymtab_strings", SHT_PROGBITS, SHF_ALLOC, ksymstr, 1, 1))
    sec_index = {name: i + 1 for i, (name, *_rest) in enumerate(sections)}   # index 0 is SHN_UNDEF

    strtab = _StrTab()
    locals_: list[bytes] = [bytes(24)]   # the null symbol

    def sym(name: str, value: int, size: int, bind: int, typ: int, shndx: int) -> bytes:
        return struct.pack("<IBBHQQ", strtab.add(name), (bind << 4) | typ, 0, shndx, value, size)

    for name, idx in sec_index.items():
        locals_.append(struct.pack("<IBBHQQ", 0, (STB_LOCAL << 4) | STT_SECTION, 0, idx, 0, 0))
    globals_: list[bytes] = []
    globals_.append(sym("__this_module", 0, THIS_MODULE_SIZE, STB_GLOBAL, STT_OBJECT,
                        sec_index[".gnu.linkonce.this_module"]))
    for i, e in enumerate(mod.exports):
        globals_.append(sym(e, i * 16, 16, STB_GLOBAL, STT_FUNC, sec_index[".text"]))
        globals_.append(sym(f"__ksymtab_{e}", 0, 0, STB_GLOBAL, STT_NOTYPE, sec_index[".text"]))
    for imp in mod.imports:
        globals_.append(sym(imp, 0, 0, STB_GLOBAL, STT_NOTYPE, SHN_UNDEF))
    symtab = b"".join(locals_ + globals_)

    sections.append((".symtab", SHT_SYMTAB, 0, symtab, 8, 24))
    symtab_idx = len(sections)
    sections.append((".strtab", SHT_STRTAB, 0, bytes(strtab.data), 1, 0))
    strtab_idx = len(sections)
    shstr = _StrTab()
    for name, *_ in sections:
        shstr.add(name)
    shstr.add(".shstrtab")
    sections.append((".shstrtab", SHT_STRTAB, 0, bytes(shstr.data), 1, 0))
    shstrndx = len(sections)

    body = bytearray()
    offsets: list[int] = []
    pos = 64
    for _name, _t, _f, data, align, _e in sections:
        pad = (-pos) % align
        body += bytes(pad)
        pos += pad
        offsets.append(pos)
        body += data
        pos += len(data)
    pad = (-pos) % 8
    body += bytes(pad)
    shoff = pos + pad

    shdrs = bytearray(bytes(64))   # null section header
    for i, (name, typ, flags, data, align, entsize) in enumerate(sections):
        link = info = 0
        if typ == SHT_SYMTAB:
            link = strtab_idx
            info = len(locals_)            # index of the first non-local symbol
        shdrs += struct.pack("<IIQQQQIIQQ", shstr.index[name], typ, flags, 0, offsets[i], len(data),
                             link, info, align, entsize)
    assert symtab_idx and shstrndx
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)   # ELFCLASS64, little-endian, version 1, SysV
    header = ident + struct.pack("<HHIQQQIHHHHHH", ET_REL, EM_BY_ARCH[arch], 1, 0, 0, shoff, 0, 64, 0, 0,
                                 64, len(sections) + 1, shstrndx)
    return bytes(header) + bytes(body) + bytes(shdrs)


def write_module(mod: FakeModule, directory: str | os.PathLike, arch: str = "x86_64") -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / mod.filename
    path.write_bytes(elf_bytes(mod, arch))
    path.chmod(0o644)
    return path


# -- the NVIDIA module set ----------------------------------------------------------------------

NVIDIA_GSP_FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")


def nvidia_modules(version: str = DEFAULT_VERSION, release: str = DEFAULT_RELEASE, *, flavor: str = "open",
                   vermagic: str | None = None, text_size: int = 64) -> list[FakeModule]:
    """The five NVIDIA kernel modules with the symbol links that give the real dependency graph:
    nvidia-uvm, nvidia-modeset, nvidia-peermem -> nvidia; nvidia-drm -> nvidia-modeset (-> nvidia)."""
    vm = vermagic or default_vermagic(release)
    lic = "Dual MIT/GPL" if flavor == "open" else "NVIDIA"
    fw = tuple(f"nvidia/{version}/{f}" for f in NVIDIA_GSP_FIRMWARE) if flavor == "open" else ()
    common = dict(version=version, vermagic=vm, license=lic, text_size=text_size)
    branch = version.split(".", 1)[0]
    # IMEX channels came with the 550 branch (nv-caps-imex.c: the nvidia-caps-imex-channels region, channel 0 on
    # request); the simulated kernel registers the region for a module that declares them
    imex = (("NVreg_ImexChannelCount", "int", "Number of IMEX channels"),
            ("NVreg_CreateImexChannel0", "int", "Create IMEX channel 0")) if branch.isdigit() and int(branch) >= 550 else ()
    return [
        FakeModule("nvidia", exports=("nvUvmInterfaceRegisterGpu", "nvUvmInterfaceSessionCreate", "nvidia_get_rm_ops",
                                      "nvidia_p2p_get_pages", "nvidia_p2p_put_pages"),
                   params=(("NVreg_OpenRmEnableUnsupportedGpus", "int", "Enable unsupported GPUs"),
                           ("NVreg_EnableGpuFirmware", "int", "Use GSP firmware")) + imex,
                   firmware=fw, description="NVIDIA kernel module", **common),
        FakeModule("nvidia_uvm", depends=("nvidia",), imports=("nvUvmInterfaceRegisterGpu",
                                                                 "nvUvmInterfaceSessionCreate"),
                   params=(("uvm_perf_prefetch_enable", "uint", "Enable prefetching"),), **common),
        FakeModule("nvidia_modeset", depends=("nvidia",), imports=("nvidia_get_rm_ops",),
                   exports=("nvKmsKapiGetFunctionsTable",), **common),
        FakeModule("nvidia_drm", depends=("nvidia-modeset",), imports=("nvKmsKapiGetFunctionsTable",),
                   params=(("modeset", "bool", "Enable atomic kernel modesetting"),), **common),
        FakeModule("nvidia_peermem", depends=("nvidia",), imports=("nvidia_p2p_get_pages", "nvidia_p2p_put_pages"),
                   params=(("peerdirect_support", "int", "Set level of support for Peer-direct"),), **common),
    ]


@dataclass
class FakeBuild:
    """What `write_nvidia_build` produced: a directory shaped like a finished kbuild tree's outputs."""
    directory: Path
    modules: list[Path]
    firmware: list[Path] = field(default_factory=list)


def write_nvidia_build(directory: str | os.PathLike, version: str = DEFAULT_VERSION,
                       release: str = DEFAULT_RELEASE, *, flavor: str = "open", arch: str = "x86_64",
                       vermagic: str | None = None, sign: "Signer | None" = None, text_size: int = 64,
                       with_firmware: bool = True) -> FakeBuild:
    d = Path(directory)
    mods = [write_module(m, d / "modules", arch) for m in
            nvidia_modules(version, release, flavor=flavor, vermagic=vermagic, text_size=text_size)]
    if sign is not None:
        for p in mods:
            sign.sign(p)
    fws: list[Path] = []
    if with_firmware and flavor == "open":
        (d / "firmware").mkdir(parents=True, exist_ok=True)
        for f in NVIDIA_GSP_FIRMWARE:
            p = d / "firmware" / f
            # Deterministic filler standing in for the GSP image (the real ones are ~25-70 MB).
            p.write_bytes((f"GSP-FW {version} {f}\n".encode()) * 64)
            p.chmod(0o644)
            fws.append(p)
    return FakeBuild(d, mods, fws)


# -- signing with the kernel's own sign-file ---------------------------------------------------

def find_sign_file(headers: str | os.PathLike | None = None) -> str | None:
    """The signer for this machine's fake modules (tests sign with this machine's kbuild)."""
    from driverd.build.sign import find_sign_file as find
    return find(headers)


def make_signing_key(directory: str | os.PathLike, cn: str = "driverd test signing key") -> tuple[Path, Path]:
    """A fresh RSA key and self-signed X.509 certificate (PEM) made by openssl, for module signing."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key, cert = d / "signing_key.pem", d / "signing_cert.pem"
    subprocess.run(["openssl", "req", "-new", "-nodes", "-utf8", "-sha256", "-days", "36500", "-batch", "-x509",
                    "-newkey", "rsa:2048", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={cn}",
                    "-addext", "extendedKeyUsage=codeSigning"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@dataclass
class Signer:
    """A key and certificate that sign fake modules with the kernel's own `sign-file`."""
    key: Path
    cert: Path
    sign_file: str
    hash_algo: str = "sha256"

    def sign(self, module: str | os.PathLike) -> None:
        subprocess.run([self.sign_file, self.hash_algo, str(self.key), str(self.cert), os.fspath(module)],
                       check=True, capture_output=True, timeout=60)


def test_signer(directory: str | os.PathLike, headers: str | None = None) -> Signer | None:
    """A Signer with a new key, or None when sign-file or openssl is missing."""
    sf = find_sign_file(headers)
    if not sf or not shutil.which("openssl"):
        return None
    key, cert = make_signing_key(directory)
    return Signer(key, cert, sf)

