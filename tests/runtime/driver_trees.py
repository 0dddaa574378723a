"""Host trees with an NVIDIA driver user-space made of real ELF shared objects (gcc -shared with the
driver's sonames), in the layouts driverd must read: the device's /usr/local/nvidia (lib64, bin,
firmware), the GPU Operator's /run/nvidia/driver, Debian's nvidia/current with alternatives links, and
two versions side by side. nvidia-ctk reads the same trees (ELF sonames, symlinks, char devices), so
driverd's CDI spec and NVIDIA's can be compared on one host."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import require_binary

NEW = "580.159.04"
OLD = "535.261.03"
# (soname, whether the file is named after the soname + version) of the compute/utility libraries a
# 580 driver ships (libnvidia-gpucomp and the pkcs11 libraries carry the full version as their soname).
LIBS = (("libcuda.so.1", True), ("libnvidia-ml.so.1", True), ("libnvidia-ptxjitcompiler.so.1", True),
        ("libnvidia-nvvm.so.4", True), ("libcudadebugger.so.1", True), ("libnvidia-opencl.so.1", True),
        ("libnvidia-cfg.so.1", True), ("libnvidia-allocator.so.1", True), ("libnvidia-gpucomp.so.{v}", False),
        ("libnvidia-pkcs11-openssl3.so.{v}", False), ("libnvidia-pkcs11.so.{v}", False))
# Graphics libraries as the device's 580 driver has them: libGLX_nvidia (soname .so.0, for which
# nvidia-ctk adds libGLX_indirect.so.0) and libnvidia-eglcore (soname = file name, .so link beside it).
GRAPHICS = (("libGLX_nvidia.so.0", True), ("libnvidia-eglcore.so.{v}", False))
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
# go-nvml (inside nvidia-ctk) dlopens libnvidia-ml and calls nvmlInit: the stand-in answers "driver not
# loaded" (NVML_ERROR_DRIVER_NOT_LOADED) instead of crashing the generator with a missing symbol.
NVML_C = """int nvmlInit(void){return 9;} int nvmlInit_v2(void){return 9;} int nvmlInitWithFlags(unsigned f){return 9;}
int nvmlShutdown(void){return 0;} const char *nvmlErrorString(int r){return "driver not loaded (stand-in)";}
int nvmlSystemGetDriverVersion(char *v, unsigned n){return 9;}
"""
# libcuda: cuInit/cuDriverGetVersion, so a program in a container can prove it loaded *this* library.
CUDA_C = """int cuInit(unsigned f){return 0;} int cuDriverGetVersion(int *v){*v=%d; return 0;}
const char *driverd_standin_version(void){return "%s";}
"""
OTHER_C = "int driverd_standin(void){return 0;}\n"


@dataclass
class Layout:
    name: str
    driver_root: str          # "/" for the host's own directories
    lib_dir: str              # where the real library files are (host path)
    link_dir: str             # where libcuda.so.1 & co. are (Debian: the multiarch dir above nvidia/current)
    bin_dir: str
    firmware_dir: str         # the directory that holds nvidia/<version>/


DEVICE = Layout("device", "/usr/local/nvidia", "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib64",
                "/usr/local/nvidia/bin", "/usr/local/nvidia/firmware")
OPERATOR = Layout("operator", "/run/nvidia/driver", "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
                  "/run/nvidia/driver/usr/lib/x86_64-linux-gnu", "/run/nvidia/driver/usr/bin",
                  "/run/nvidia/driver/lib/firmware")
DEBIAN = Layout("debian", "/", "/usr/lib/x86_64-linux-gnu/nvidia/current", "/usr/lib/x86_64-linux-gnu",
                "/usr/lib/nvidia/current", "/lib/firmware")


def _build(cache: Path, soname: str, source: str) -> Path:
    """A shared object with `soname` (built once per cache directory)."""
    out = cache / f"{soname}.{hashlib.sha256(source.encode()).hexdigest()[:12]}.so"
    if not out.exists():
        gcc = require_binary("gcc")
        src = cache / f"{out.name}.c"
        src.write_text(source)
        subprocess.run([gcc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)],
                       check=True, capture_output=True)
    return out


def _p(host: Path, hostpath: str) -> Path:
    return host / hostpath.lstrip("/")


def _link(host: Path, hostpath: str, target: str) -> None:
    p = _p(host, hostpath)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.is_symlink() or p.exists():
        p.unlink()
    os.symlink(target, p)


def _target(link: str, target: str, absolute: bool) -> str:
    """Debian's alternatives links are absolute; relative ones let a tool that follows links on the
    machine it runs on (nvidia-ctk) stay inside the tree."""
    return target if absolute else os.path.relpath(target, os.path.dirname(link))


def add_userspace(host: Path, layout: Layout, version: str, cache: Path, *, links: bool = True,
                  absolute_links: bool = True, binaries: bool = True, firmware: bool = True,
                  graphics: bool = False) -> list[str]:
    """The driver user-space of `version` in `layout`; returns the host paths of the real libraries."""
    cache.mkdir(parents=True, exist_ok=True)
    lib_dir = _p(host, layout.lib_dir)
    lib_dir.mkdir(parents=True, exist_ok=True)
    real = []
    for soname_t, versioned in LIBS + (GRAPHICS if graphics else ()):
        soname = soname_t.format(v=version)
        base = soname.split(".so")[0]
        name = f"{base}.so.{version}"
        if base == "libnvidia-ml":
            src = NVML_C
        elif base == "libcuda":
            src = CUDA_C % (int(version.split(".")[0]) * 1000, version)
        else:
            src = OTHER_C
        shutil.copyfile(_build(cache, soname, src), lib_dir / name)
        real.append(f"{layout.lib_dir}/{name}")
        if links and versioned:
            _link(host, f"{layout.lib_dir}/{soname}", name)          # what ldconfig makes next to the file
            if layout.link_dir != layout.lib_dir:                      # Debian: through the alternatives
                alt = f"/etc/alternatives/nvidia--{soname}-x86_64-linux-gnu"
                _link(host, alt, _target(alt, f"{layout.lib_dir}/{soname}", absolute_links))
                _link(host, f"{layout.link_dir}/{soname}", _target(f"{layout.link_dir}/{soname}", alt, absolute_links))
        if links and soname in ("libcuda.so.1", "libnvidia-ml.so.1", "libGLX_nvidia.so.0", f"libnvidia-eglcore.so.{version}"):
            _link(host, f"{layout.lib_dir}/{base}.so", soname)      # the .so links the .run installer makes
    if binaries:
        b = _p(host, layout.bin_dir)
        b.mkdir(parents=True, exist_ok=True)
        for n in BINARIES:
            (b / n).write_text(f"#!/bin/sh\necho {n} {version}\n")
            (b / n).chmod(0o755)
            if layout is DEBIAN:
                alt = f"/etc/alternatives/nvidia--{n}"
                _link(host, alt, _target(alt, f"{layout.bin_dir}/{n}", absolute_links))
                _link(host, f"/usr/bin/{n}", _target(f"/usr/bin/{n}", alt, absolute_links))
    if firmware:
        fw = _p(host, f"{layout.firmware_dir}/nvidia/{version}")
        fw.mkdir(parents=True, exist_ok=True)
        for n in FIRMWARE:
            (fw / n).write_bytes(b"GSP " + version.encode())
    return real


def add_gpus(host: Path, n: int = 2, *, char_devices: bool = True, caps: bool = True, osrelease: str | None = None) -> list[str]:
    """/proc/driver/nvidia/gpus/*/information and the device nodes of `n` GPUs: real character devices
    (major 195, as the driver's) when this process may mknod them, plain files otherwise."""
    uuids = []
    for i in range(n):
        uuid = f"GPU-0000000{i}-1111-2222-3333-44444444444{i}"
        uuids.append(uuid)
        info = host / f"proc/driver/nvidia/gpus/0000:{0x17 + i:02x}:00.0/information"
        info.parent.mkdir(parents=True, exist_ok=True)
        info.write_text(f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {uuid}\nDevice Minor: \t {i}\n")
    if osrelease:
        (host / "proc/sys/kernel").mkdir(parents=True, exist_ok=True)
        (host / "proc/sys/kernel/osrelease").write_text(osrelease + "\n")
    nodes = [(f"nvidia{i}", 195, i) for i in range(n)] + [("nvidiactl", 195, 255), ("nvidia-uvm", 510, 0),
                                                          ("nvidia-uvm-tools", 510, 1)]
    if caps:
        nodes += [("nvidia-caps/nvidia-cap1", 235, 1), ("nvidia-caps/nvidia-cap2", 235, 2)]
    for name, major, minor in nodes:
        p = host / "dev" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists():
            continue
        if char_devices:
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        else:
            p.touch()
    return uuids


def can_mknod(tmp: Path) -> bool:
    try:
        os.mknod(tmp / ".probe", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError:
        return False
    (tmp / ".probe").unlink()
    return True


def add_socket(host: Path, hostpath: str) -> None:
    """A socket file (mknod S_IFSOCK: no path-length limit of bind(2))."""
    p = _p(host, hostpath)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(p, stat.S_IFSOCK | 0o666)


def add_hook(host: Path, hostpath: str = "/usr/bin/nvidia-cdi-hook") -> None:
    p = _p(host, hostpath)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
