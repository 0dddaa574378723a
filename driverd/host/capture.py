"""`driverd debug capture-host`: pack exactly the files detect reads into a host-tree tarball.

detect runs against a recording Root; every host path it touched (files, directory listings,
symlinks on the way) goes into the tarball with its *content* (sysfs/procfs files report a size
of 0 or 4096, so they are read, not copied). Unpacked, the tree behaves like the host under --root.
"""
from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
import time
from dataclasses import asdict

from driverd.root import Root

MAX_FILE = 1 << 20
_PROC_PID = re.compile(r"^/proc/(\d+)(/|$)")


def _add_dirs(tar: tarfile.TarFile, hostpath: str, done: set[str], mtime: float) -> None:
    parts = hostpath.strip("/").split("/")[:-1]
    for i in range(1, len(parts) + 1):
        d = "/".join(parts[:i])
        if d not in done:
            done.add(d)
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, mtime
            tar.addfile(ti)


def _add_json(tar: tarfile.TarFile, hostpath: str, obj: object, done: set[str], mtime: float) -> None:
    data = (json.dumps(obj, indent=2) + "\n").encode()
    _add_dirs(tar, hostpath, done, mtime)
    ti = tarfile.TarInfo(hostpath.lstrip("/"))
    ti.size, ti.mtime, ti.mode = len(data), mtime, 0o644
    tar.addfile(ti, io.BytesIO(data))


def capture(root: Root, out: str) -> dict:
    from driverd.host import collect
    from driverd.host.nvml import CAPTURE_PATH
    from driverd.host.runtimes import CAPTURED_VERSIONS

    rec = Root(root.base, record=True)
    facts = collect(rec, nvml=True)
    keep_pids = {str(u.pid) for u in facts.gpu_users} | {str(p) for d in facts.daemons for p in d.pids}
    paths = sorted(rec.recorded or ())
    mtime = time.time()
    done: set[str] = set()
    files = total = 0
    with tarfile.open(out, "w:gz") as tar:
        for hp in paths:
            m = _PROC_PID.match(hp)
            if m and m.group(1) not in keep_pids:
                continue
            if hp == "/" or hp.startswith("/proc/self"):
                continue
            real = rec.path(hp)
            try:
                st = os.lstat(real)
            except OSError:
                continue
            name = hp.lstrip("/")
            ti = tarfile.TarInfo(name)
            ti.mtime = mtime
            if stat.S_ISLNK(st.st_mode):
                _add_dirs(tar, hp, done, mtime)
                ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(real)
                tar.addfile(ti)
            elif stat.S_ISDIR(st.st_mode):
                _add_dirs(tar, hp + "/x", done, mtime)
            elif stat.S_ISREG(st.st_mode):
                try:
                    with open(real, "rb") as f:
                        data = f.read(MAX_FILE + 1)
                except OSError:
                    continue
                if len(data) > MAX_FILE:
                    continue
                _add_dirs(tar, hp, done, mtime)
                ti.size, ti.mode = len(data), stat.S_IMODE(st.st_mode) or 0o444
                tar.addfile(ti, io.BytesIO(data))
                files += 1
                total += len(data)
        # Binaries are not packed; a placeholder keeps "binary present" true and their version is recorded.
        versions = {r.binary: r.version for r in facts.runtimes if r.binary}
        for b in versions:
            _add_dirs(tar, b, done, mtime)
            ti = tarfile.TarInfo(b.lstrip("/"))
            ti.mode, ti.mtime = 0o755, mtime
            tar.addfile(ti, io.BytesIO(b""))
        _add_json(tar, CAPTURED_VERSIONS, versions, done, mtime)
        report = asdict(facts.nvml)
        report["source"] = "capture"
        _add_json(tar, CAPTURE_PATH, report, done, mtime)
        files += 2 + len(versions)
    return {"out": out, "files": files, "bytes": total, "gpus": len(facts.gpus),
            "nvml_available": facts.nvml.available}
