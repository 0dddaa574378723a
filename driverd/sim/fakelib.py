"""Small but real shared-library files (ELF64 ET_DYN with a dynamic section naming their soname) and a
miniature NVIDIA user-space made of them, written in pure Python for the demo and the simulated fleet.

`ldconfig` caches them under their sonames and driverd's ELF reader finds the same soname, so a
user-space package built from them installs, switches and rolls back like one built from NVIDIA's files.
They hold no code: nothing can call into them (the simulated host makes no CUDA call; the workload check
is for real kernels)."""
from __future__ import annotations

import os
import struct
from pathlib import Path

PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_STRTAB, DT_STRSZ, DT_SONAME = 0, 5, 10, 14
SHT_STRTAB, SHT_DYNAMIC = 3, 6
SHF_WRITE, SHF_ALLOC = 0x1, 0x2
EM_BY_ARCH = {"x86_64": 62, "aarch64": 183}

# the libraries of the miniature driver: (file stem, soname with {v} for the version)
LIBRARIES = (("libcuda", "libcuda.so.1"), ("libnvidia-ml", "libnvidia-ml.so.1"),
             ("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"), ("libnvidia-nvvm", "libnvidia-nvvm.so.4"),
             ("libnvidia-cfg", "libnvidia-cfg.so.1"), ("libnvcuvid", "libnvcuvid.so.1"),
             ("libnvidia-encode", "libnvidia-encode.so.1"), ("libnvidia-eglcore", "libnvidia-eglcore.so.{v}"),
             ("libEGL_nvidia", "libEGL_nvidia.so.0"), ("libGLX_nvidia", "libGLX_nvidia.so.0"))
BINARIES = ("nvidia-smi", "nvidia-persistenced", "nvidia-modprobe", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")


def shared_object(soname: str, arch: str = "x86_64", note: str = "") -> bytes:
    """One PT_LOAD mapping the whole file at address 0 (so addresses are file offsets) and a PT_DYNAMIC
    whose DT_STRTAB/DT_SONAME give the soname — what ldconfig and a loader read — and the matching
    section headers (.dynstr, .dynamic), which readelf and driverd's reader read."""
    ehsize, phsize, shsize = 64, 56, 64
    strtab = b"\0" + soname.encode() + b"\0" + note.encode() + b"\0"
    str_off = ehsize + 2 * phsize
    dyn_off = (str_off + len(strtab) + 7) & ~7
    dyn = b"".join(struct.pack("<qQ", t, v) for t, v in ((DT_STRTAB, str_off), (DT_STRSZ, len(strtab)),
                                                          (DT_SONAME, 1), (DT_NULL, 0)))
    shstr = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    shstr_off = dyn_off + len(dyn)
    sh_off = (shstr_off + len(shstr) + 7) & ~7
    loaded = shstr_off
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, EM_BY_ARCH[arch], 1, 0, ehsize, sh_off, 0, ehsize, phsize, 2,
                                 shsize, 4, 3)
    load = struct.pack("<IIQQQQQQ", PT_LOAD, 4, 0, 0, 0, loaded, loaded, 0x1000)
    dynamic = struct.pack("<IIQQQQQQ", PT_DYNAMIC, 4, dyn_off, dyn_off, dyn_off, len(dyn), len(dyn), 8)
    # (name offset in .shstrtab, type, flags, address, offset, size, link, entsize)
    sections = [(0, 0, 0, 0, 0, 0, 0, 0), (1, SHT_STRTAB, SHF_ALLOC, str_off, str_off, len(strtab), 0, 0),
                (9, SHT_DYNAMIC, SHF_ALLOC | SHF_WRITE, dyn_off, dyn_off, len(dyn), 1, 16),
                (18, SHT_STRTAB, 0, 0, shstr_off, len(shstr), 0, 0)]
    table = b"".join(struct.pack("<IIQQQQIIQQ", n, t, fl, a, o, sz, ln, 0, 8 if t == SHT_DYNAMIC else 1, es)
                     for n, t, fl, a, o, sz, ln, es in sections)
    out = header + load + dynamic + strtab
    out += bytes(dyn_off - len(out)) + dyn + shstr
    return out + bytes(sh_off - len(out)) + table


def run_dir(dest: str | os.PathLike, version: str, arch: str = "x86_64") -> Path:
    """NVIDIA-Linux-<arch>-<version>/ as `--extract-only` lays it out, in miniature: what
    `driverd build-userspace --from-run-dir` reads."""
    d = Path(dest) / f"NVIDIA-Linux-{arch}-{version}"
    d.mkdir(parents=True, exist_ok=True)
    for stem, soname in LIBRARIES:
        (d / f"{stem}.so.{version}").write_bytes(shared_object(soname.format(v=version), arch,
                                                               f"driverd simulated {stem} {version}"))
    for b in BINARIES:
        (d / b).write_text(f"#!/bin/sh\necho '{b}: simulated NVIDIA user-space {version} (driverd demo)'\n")
        os.chmod(d / b, 0o755)
    (d / "firmware").mkdir(exist_ok=True)
    for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        (d / "firmware" / fw).write_bytes(f"simulated {fw} {version}\n".encode() * 32)
    (d / "10_nvidia.json").write_text('{"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}\n')
    (d / ".manifest").write_text(f"NVIDIA-Linux-{arch}-{version}\n{version}\n")
    return d
