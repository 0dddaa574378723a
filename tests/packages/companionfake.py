"""NVIDIA's companion archives in miniature, for the tests (never in the wheel).

No real archive is reachable from the machines this suite runs on, so the tests make their own in the layout
NVIDIA publishes (the NVIDIA Driver Installation Guide, "Tarballs and Zip Archive Deliverables"):
`<key>-linux-<platform>-<version>-archive.tar.xz`, one top directory of that name, and in it what packagers of the
real archives read: fabric manager's bin/ (nv-fabricmanager, nvswitch-audit), etc/fabricmanager.cfg, include/,
lib/libnvfm.so.1 with its link, sbin/, share/nvidia/nvswitch/ topologies, systemd/ and LICENSE; nscq's
lib/libnvidia-nscq.so.<version> with its chain of links (.so.2.0, .so.2, .so); NVLSM's sbin/nvlsm, lib/,
share/nvidia/nvlsm/ (its own version, 2025.03.9); IMEX's bin/nvidia-imex and -ctl, etc/nvidia-imex/ and its unit.
The libraries are real ELF shared objects with those sonames, compiled by gcc (tests/packages/usfake.py).
`redistrib()` writes the redistrib_<version>.json NVIDIA publishes beside them.
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

from tests.packages import usfake

V = "550.163.01"
NVLSM_V = "2025.03.9"
KEYS = {"fabricmanager": "fabricmanager", "nscq": "libnvidia_nscq", "nvlsm": "nvlsm", "imex": "nvidia_imex"}


@dataclass(frozen=True)
class M:
    """One member under the archive's top directory."""
    path: str
    data: bytes | None = None      # a regular file's bytes (None: see `so`, `link`, `kind`)
    mode: int = 0o644
    link: str | None = None        # a symlink's target
    so: str | None = None          # a real ELF shared object with this soname
    kind: str = "file"             # file | link | dir | hard | fifo


def _script(name: str, version: str) -> bytes:
    return f"#!/bin/sh\necho '{name} {version}'\n".encode()


def members(component: str, version: str = V) -> list[M]:
    docs = [M("LICENSE", b"NVIDIA Software License Agreement\n" * 20), M("third-party-notices.txt", b"notices\n")]
    if component == "fabricmanager":
        return docs + [
            M("bin/nv-fabricmanager", _script("nv-fabricmanager", version), 0o755),
            M("bin/nvswitch-audit", _script("nvswitch-audit", version), 0o755),
            M("etc/fabricmanager.cfg", b"LOG_LEVEL=4\nDAEMONIZE=1\nFABRIC_MODE=0\n"),
            M("include/nv_fm_agent.h", b"/* fm agent */\n"), M("include/nv_fm_types.h", b"/* fm types */\n"),
            M("lib/libnvfm.so.1", so="libnvfm.so.1", mode=0o755), M("lib/libnvfm.so", link="libnvfm.so.1", kind="link"),
            M("sbin/fm_run_package_installer.sh", _script("fm_run_package_installer", version), 0o755),
            M("share/nvidia/nvswitch/dgxa100_hgxa100_topology", b"topology A100\n" * 50),
            M("share/nvidia/nvswitch/dgx2_hgx2_topology", b"topology V100\n" * 50),
            M("systemd/nvidia-fabricmanager.service", b"[Service]\nExecStart=/usr/bin/nv-fabricmanager\n")]
    if component == "nscq":
        lib = f"libnvidia-nscq.so.{version}"
        return docs[:1] + [
            M("bin/nscq-cli", _script("nscq-cli", version), 0o755),
            M(f"lib/{lib}", so="libnvidia-nscq.so.2", mode=0o755),
            M("lib/libnvidia-nscq.so.2.0", link=lib, kind="link"),
            M("lib/libnvidia-nscq.so.2", link="libnvidia-nscq.so.2.0", kind="link"),
            M("lib/libnvidia-nscq.so", link="libnvidia-nscq.so.2", kind="link")]
    if component == "nvlsm":
        return docs + [
            M("sbin/nvlsm", _script("nvlsm", version), 0o755),
            M("lib/libgrmapi.so", so="libgrmapi.so"),
            M("share/nvidia/nvlsm/nvlsm.conf", b"# nvlsm\nsm_priority 15\n")]
    if component == "imex":
        return docs[:1] + [
            M("bin/nvidia-imex", _script("nvidia-imex", version), 0o755),
            M("bin/nvidia-imex-ctl", _script("nvidia-imex-ctl", version), 0o755),
            M("etc/nvidia-imex/config.cfg", b"IMEX_PORT=50000\n"), M("etc/nvidia-imex/nodes_config.cfg", b""),
            M("systemd/nvidia-imex.service", b"[Service]\nExecStart=/usr/bin/nvidia-imex -c /etc/nvidia-imex/config.cfg\n")]
    raise ValueError(component)


def archive(dest: Path, component: str, version: str | None = None, platform: str = "x86_64", *,
            edit=None, key: str | None = None, mtime: int = 1700000000, reverse: bool = False,
            top: str | None = None) -> Path:
    """NVIDIA's archive of `component` in `dest`; `edit(list[M]) -> list[M]` changes its members first.
    `mtime`/`reverse` change what a repacking by someone else changes (times, member order), not the files."""
    version = version or (NVLSM_V if component == "nvlsm" else V)
    key = key or KEYS[component]
    name = f"{key}-linux-{platform}-{version}-archive"
    top = name if top is None else top
    ms = members(component, version)
    if edit is not None:
        ms = edit(ms)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        dirs = sorted({"/".join(m.path.split("/")[:i]) for m in ms for i in range(1, m.path.count("/") + 1)})
        entries = [(top, None)] + [(f"{top}/{d}", None) for d in dirs] + [(f"{top}/{m.path}", m) for m in ms]
        for n, m in (reversed(entries) if reverse else entries):
            ti = tarfile.TarInfo(n)
            ti.mtime, ti.uname, ti.gname = mtime, "root", "root"
            if m is None or m.kind == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(ti)
            elif m.kind == "link":
                ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, m.link or "", 0o777
                tar.addfile(ti)
            elif m.kind == "hard":
                ti.type, ti.linkname = tarfile.LNKTYPE, f"{top}/{m.link}"
                tar.addfile(ti)
            elif m.kind == "fifo":
                ti.type = tarfile.FIFOTYPE
                tar.addfile(ti)
            else:
                data = m.data if m.so is None else usfake._so(m.so).read_bytes()
                ti.size, ti.mode = len(data or b""), m.mode
                tar.addfile(ti, io.BytesIO(data or b""))
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{name}.tar.xz"
    out.write_bytes(lzma.compress(buf.getvalue(), preset=1))
    return out


def redistrib(dest: Path, archives: list[Path], release_label: str = V, *, product: str = "nvidia-driver",
              edit=None) -> Path:
    """NVIDIA's redistrib_<release_label>.json listing `archives` (their real size and sha256); `edit(dict)`
    changes it before it is written."""
    d: dict = {"release_date": "2025-04-17", "release_label": release_label, "release_product": product}
    for a in archives:
        key, rest = a.name.split("-linux-", 1)
        platform, rest = rest.split("-", 1)
        version = rest.removesuffix("-archive.tar.xz")
        data = a.read_bytes()
        comp = d.setdefault(key, {"name": f"NVIDIA {key}", "license": "NVIDIA Driver",
                                  "license_path": f"{key}/LICENSE.txt", "version": version})
        comp[f"linux-{platform}"] = {"relative_path": f"{key}/linux-{platform}/{a.name}",
                                     "sha256": hashlib.sha256(data).hexdigest(),
                                     "md5": hashlib.md5(data).hexdigest(), "size": str(len(data))}
    if edit is not None:
        edit(d)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"redistrib_{release_label}.json"
    out.write_text(json.dumps(d, indent=4))
    return out


def swap(ms: list[M], path: str, **changes) -> list[M]:
    """`ms` with the member at `path` changed (or added when absent)."""
    if not any(m.path == path for m in ms):
        return ms + [M(path, **changes)]
    return [replace(m, **changes) if m.path == path else m for m in ms]
