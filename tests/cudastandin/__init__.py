"""Stand-in libnvidia-ml.so.1 and libcuda.so.1 (tests only; never in the wheel or the image), compiled with
gcc into a host tree the way a driver's user-space sits there: the versioned file, its soname link.

They behave like NVIDIA's for the paths the workload check judges: the loaded kernel module's version is
read from the tree's /proc/driver/nvidia/version (another version: NVML 18 "NVML/RM version mismatch",
cuInit 803 CUDA_ERROR_SYSTEM_DRIVER_MISMATCH; none: NVML 9, cuInit 100), the GPUs are the PCI bus ids
given, and a scenario can hang cuInit, fail one GPU's context, corrupt the memory round trip, or report
an NVLink fabric state.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
_CACHE = Path(os.environ.get("TMPDIR", "/tmp")) / "driverd-cudastandin"


def _compile(src: str, soname: str, defines: dict[str, str]) -> Path:
    flags = [f"-D{k}={v}" for k, v in sorted(defines.items())]
    key = hashlib.sha256(repr((src, soname, flags, (HERE / src).read_bytes(), (HERE / "standin.h").read_bytes()))
                         .encode()).hexdigest()[:16]
    out = _CACHE / key / soname
    if not out.is_file():
        gcc = shutil.which("gcc") or shutil.which("cc")
        if not gcc:
            raise RuntimeError("gcc is needed to build the stand-in NVIDIA libraries (apt-get install build-essential)")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        subprocess.run([gcc, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{soname}", "-o", str(tmp), *flags,
                        str(HERE / src)], check=True, capture_output=True, text=True)
        tmp.rename(out)
    return out


def install(root: Path, version: str, gpus: list[str], *, libdir: str = "/usr/lib/x86_64-linux-gnu",
            hang: bool = False, fail_device: int | None = None, corrupt: bool = False,
            hang_device: int | None = None, together: bool = False,
            fabric_state: int | None = None, rm_file: Path | None = None, persistence: bool = True,
            only: tuple[str, ...] = ("nvml", "cuda")) -> Path:
    """Put the stand-ins of `version` into `root`/`libdir`; returns that directory."""
    rm = rm_file or root / "proc/driver/nvidia/version"
    common = {"STANDIN_VERSION": f'"{version}"', "STANDIN_RM_FILE": f'"{rm}"',
              "STANDIN_BUSIDS": '"' + ",".join(gpus) + '"'}
    d = root / libdir.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    if "nvml" in only:
        nvml = dict(common, **({"STANDIN_FABRIC_STATE": str(fabric_state)} if fabric_state is not None else {}))
        if not persistence:
            nvml["STANDIN_PERSISTENCE_OFF"] = "1"
        _place(_compile("nvml.c", "libnvidia-ml.so.1", nvml), d, "libnvidia-ml", version)
    if "cuda" in only:
        cuda = dict(common)
        if hang:
            cuda["STANDIN_HANG"] = "1"
        if fail_device is not None:
            cuda["STANDIN_FAIL_DEVICE"] = str(fail_device)
        if corrupt:
            cuda["STANDIN_CORRUPT"] = "1"
        if hang_device is not None:
            cuda["STANDIN_HANG_DEVICE"] = str(hang_device)
        if together:
            cuda["STANDIN_TOGETHER"] = "1"
        _place(_compile("cuda.c", "libcuda.so.1", cuda), d, "libcuda", version)
    return d


def _place(built: Path, d: Path, stem: str, version: str) -> None:
    real = d / f"{stem}.so.{version}"
    shutil.copy2(built, real)
    for link in (d / f"{stem}.so.1", d / f"{stem}.so"):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(real.name)
