"""Small user-space sources and packages for the tests (never in the wheel).

- `run_dir(dest, version, ...)`: the directory `sh NVIDIA-Linux-x86_64-<version>.run --extract-only` makes, in
  miniature: real ELF shared objects compiled with gcc under the driver's sonames — libcuda and libnvidia-ml are
  tests/cudastandin's stand-ins (they answer the workload check like NVIDIA's for a host tree's
  /proc/driver/nvidia/version) — plus the binaries (shell scripts), firmware/, the ICD files, kernel-open/ and 32/.
- `plain_package(out, version)`: a user-space package packed straight from a manifest whose "libraries" are a few
  bytes (no compiler): a seed for the fuzzer and the archive checks, never installed.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from tests import cudastandin
from tests.conftest import require_binary

# (file stem, soname with {v} for the version) of the libraries the miniature .run holds besides the two key ones
OTHERS = (("libnvidia-ptxjitcompiler", "libnvidia-ptxjitcompiler.so.1"), ("libnvidia-nvvm", "libnvidia-nvvm.so.4"),
          ("libnvidia-eglcore", "libnvidia-eglcore.so.{v}"), ("libEGL_nvidia", "libEGL_nvidia.so.0"),
          ("libGLX_nvidia", "libGLX_nvidia.so.0"), ("libnvcuvid", "libnvcuvid.so.1"))
_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "driverd-usfake"


def require_ldconfig() -> None:
    """`ldconfig -r ROOT` chroots: the user-space install tests run as root (CI does)."""
    require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    if os.geteuid() != 0:
        from tests.conftest import missing_component
        missing_component("ldconfig -r ROOT chroots: the user-space install tests run as root (CI does)")


def _so(soname: str) -> Path:
    out = _CACHE / hashlib.sha256(soname.encode()).hexdigest()[:16] / "lib.so"
    if not out.is_file():
        gcc = require_binary("gcc", "cc")
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.parent / "x.c"
        src.write_text(f'const char *driverd_usfake_soname(void){{return "{soname}";}}\n')
        tmp = out.with_suffix(".tmp")
        subprocess.run([gcc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(tmp), str(src)], check=True,
                       capture_output=True)
        tmp.rename(out)
    return out


def run_dir(dest: Path, version: str, *, rm_file: Path | None = None, gpus: tuple[str, ...] = (),
            icd_template: bool = True) -> Path:
    """NVIDIA-Linux-x86_64-<version>/ under `dest`, as --extract-only lays it out (in miniature)."""
    require_binary("gcc", "cc")
    d = dest / f"NVIDIA-Linux-x86_64-{version}"
    d.mkdir(parents=True)
    common = {"STANDIN_VERSION": f'"{version}"', "STANDIN_RM_FILE": f'"{rm_file or "/proc/driver/nvidia/version"}"',
              "STANDIN_BUSIDS": '"' + ",".join(gpus) + '"'}
    shutil.copy(cudastandin._compile("nvml.c", "libnvidia-ml.so.1", common), d / f"libnvidia-ml.so.{version}")
    shutil.copy(cudastandin._compile("cuda.c", "libcuda.so.1", dict(common)), d / f"libcuda.so.{version}")
    for stem, soname in OTHERS:
        shutil.copy(_so(soname.format(v=version)), d / f"{stem}.so.{version}")
    shutil.copy(_so(f"libglxserver_nvidia.so.{version}"), d / f"libglxserver_nvidia.so.{version}")  # X server's
    shutil.copy(_so("libnvidia-egl-wayland.so.1"), d / "libnvidia-egl-wayland.so.1.1.13")        # another version
    for b in ("nvidia-smi", "nvidia-persistenced", "nvidia-modprobe", "nvidia-cuda-mps-control",
              "nvidia-cuda-mps-server", "nvidia-debugdump", "nvidia-installer"):
        (d / b).write_text(f"#!/bin/sh\necho '{b} {version}'\n")
        os.chmod(d / b, 0o755)
    (d / "firmware").mkdir()
    for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        (d / "firmware" / fw).write_bytes(f"{fw} {version}\n".encode() * 64)
    (d / "10_nvidia.json").write_text('{"file_format_version": "1.0.0", "ICD": {"library_path": "libEGL_nvidia.so.0"}}\n')
    (d / "10_nvidia_wayland.json").write_text('{"ICD": {"library_path": "libnvidia-egl-wayland.so.1"}}\n')
    icd = '{"file_format_version": "1.0.0", "ICD": {"library_path": "__NV_VK_ICD__", "api_version": "1.3.0"}}\n'
    if icd_template:
        (d / "nvidia_icd.json.template").write_text(icd)
    else:
        (d / "nvidia_icd.json").write_text(icd.replace("__NV_VK_ICD__", "libGLX_nvidia.so.0"))
    for k in ("kernel", "kernel-open"):
        (d / k).mkdir()
        (d / k / "Makefile").write_text("# the module sources\n")
    (d / "32").mkdir()
    shutil.copy(_so("libcuda.so.1"), d / "32" / f"libcuda.so.{version}")
    (d / ".manifest").write_text(f"NVIDIA-Linux-x86_64-{version}\n{version}\n")
    return d


def plain_package(out: Path, version: str = "550.163.01"):
    """A user-space package packed straight from a manifest (its libraries are not ELF files)."""
    from driverd.package import userspace as us
    from driverd.package.archive import file_entry, pack
    stage = out / f"stage-{version}"
    files = {f"lib64/libcuda.so.{version}": b"cuda", f"lib64/libnvidia-ml.so.{version}": b"nvml",
             "bin/nvidia-smi": b"#!/bin/sh\n", f"firmware/nvidia/{version}/gsp_ga10x.bin": b"gsp" * 10,
             "share/glvnd/egl_vendor.d/10_nvidia.json": b"{}"}
    for rel, data in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
        os.chmod(stage / rel, 0o755 if rel.startswith("bin/") else 0o644)
    m = us.UserspaceManifest(
        driver_version=version, arch="x86_64", files=tuple(file_entry(stage / p, p) for p in sorted(files)),
        libraries=(us.Library(f"lib64/libcuda.so.{version}", "libcuda.so.1", "compute"),
                   us.Library(f"lib64/libnvidia-ml.so.{version}", "libnvidia-ml.so.1", "utility")),
        links=(us.Link("lib64/libcuda.so", "libcuda.so.1"), us.Link("lib64/libcuda.so.1", f"libcuda.so.{version}"),
               us.Link("lib64/libnvidia-ml.so.1", f"libnvidia-ml.so.{version}")),
        binaries=("bin/nvidia-smi",), provenance=us.Provenance("test", (us.Source("plain", version, None),)))
    return pack(stage, m, out)
