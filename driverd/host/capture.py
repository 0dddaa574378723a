"""`driverd debug capture-host`: pack exactly the files detect reads into a host-tree tarball.

detect runs against a recording Root; every host path it touched (files, directory listings,
symlinks on the way) goes into the tarball with its *content* (sysfs/procfs files report a size
of 0 or 4096, so they are read, not copied). Unpacked, the tree behaves like the host under --root.

Secrets never leave the host: every copied configuration file (runtime configs: containerd's registry
`auth` tables, Docker's and the containers' auth.json `auths`, CRI-O...; /proc/<pid>/cmdline) has the
values of secret-looking keys — auth, password, token, secret, credentials, private keys — replaced
with REDACTED before it is packed, and the result says which files and keys were redacted. The keys'
names and the files' shape stay, so the tree still reads like the host.

The kernel's keyring membership (which keyring holds which key; keyctl on the live host) is recorded
in driverd.host.keyrings.CAPTURE_PATH so a captured tree answers like the host.
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
REDACTED = "REDACTED"
# Key names whose values are secrets (matched case-insensitively on the whole key name).
SECRET_KEY = re.compile(r"(?i)^(auth|password|passwd|pass|identitytoken|identity_token|registrytoken|registry_token|"
                        r"token|access_token|refresh_token|bearer_token|secret|client_secret|secret_key|"
                        r"secret_access_key|aws_secret_access_key|api_key|apikey|credentials|private_key|"
                        r"privatekey|key_password)$")
_TOML_LINE = re.compile(r'^(?P<lead>\s*(?P<q>["\']?)(?P<key>[A-Za-z0-9_.-]+)(?P=q)\s*=\s*)(?P<val>.+?)\s*$')
_ARG = re.compile(r"(?i)^(--?[a-z0-9-]*(?:password|passwd|token|secret|api-key|apikey|credentials)=?)(.*)$")


def _redact_json(obj, found: list[str], path: str = ""):
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(k, str) and SECRET_KEY.match(k) and isinstance(v, (str, int, float)) and v != "":
                out[k] = REDACTED
                found.append(f"{path}{k}")
            else:
                out[k] = _redact_json(v, found, f"{path}{k}.")
        return out
    if isinstance(obj, list):
        return [_redact_json(v, found, path) for v in obj]
    return obj


def redact(hostpath: str, data: bytes) -> tuple[bytes, list[str]]:
    """The bytes to pack for a file, with secret values replaced; and the keys redacted."""
    found: list[str] = []
    if hostpath.startswith("/proc/"):
        if hostpath.endswith("/cmdline"):
            args = data.split(b"\0")
            out, secret_next = [], False
            for a in args:
                t = a.decode("utf-8", "replace")
                m = _ARG.match(t)
                if secret_next and t and not t.startswith("-"):
                    out.append(REDACTED.encode())
                    secret_next = False
                    continue
                secret_next = False
                if m and m.group(2):                # --password=X
                    out.append((m.group(1) + REDACTED).encode())
                    found.append(m.group(1).strip("-="))
                else:
                    if m and not m.group(1).endswith("="):      # --password X
                        secret_next = True
                        found.append(m.group(1).strip("-"))
                    out.append(a)
            return b"\0".join(out), found
        return data, found
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data, found
    if b"PRIVATE KEY-----" in data:
        return b"# private key removed by driverd debug capture-host\n", ["private key"]
    stripped = text.lstrip()
    if stripped.startswith(("{", "[")):
        try:
            import json as _json
            doc = _json.loads(text)
        except ValueError:
            doc = None
        if doc is not None:
            new = _redact_json(doc, found)
            return (data if not found else (_json.dumps(new, indent=2) + "\n").encode()), found
    lines = []
    for line in text.splitlines(keepends=True):
        m = _TOML_LINE.match(line.rstrip("\n"))
        key = m.group("key").rsplit(".", 1)[-1] if m else None
        if m and key and SECRET_KEY.match(key) and not m.group("val").startswith(("[", "{", '""', "''")):
            lines.append(f"{m.group('lead')}\"{REDACTED}\"\n")
            found.append(m.group("key"))
        else:
            lines.append(line)
    return ("".join(lines).encode() if found else data), found


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
    redacted: list[dict] = []
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
                data, keys = redact(hp, data)
                if keys:
                    redacted.append({"path": hp, "keys": keys})
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
        if facts.keyrings is not None and facts.keyrings.membership == "keyctl":
            from driverd.host.keyrings import CAPTURE_PATH as KEYRINGS_CAPTURE, render_capture
            _add_json(tar, KEYRINGS_CAPTURE, render_capture(facts.keyrings), done, mtime)
            files += 1
    return {"out": out, "files": files, "bytes": total, "gpus": len(facts.gpus),
            "nvml_available": facts.nvml.available, "redacted": redacted}
