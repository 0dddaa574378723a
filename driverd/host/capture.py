"""`driverd debug capture-host`: pack exactly the files detect reads into a host-tree tarball.

detect runs against a recording Root; every host path it touched (files, directory listings,
symlinks on the way) goes into the tarball with its *content* (sysfs/procfs files report a size
of 0 or 4096, so they are read, not copied). Unpacked, the tree behaves like the host under --root.

Secrets never leave the host: every copied configuration file is *parsed* — JSON, YAML, TOML
(through tomlkit, so inline tables like `auth = { username = "u", password = "p" }`, multi-line
strings and arrays are seen as values, and the file is written back with its shape) — and the values
of secret-looking keys (auth, password, x-secret-token, api_key, credentials, private keys...) are
replaced with REDACTED; every URL loses its userinfo (`https://u:p@mirror` -> `https://mirror`). A
file of one of those formats that does not parse is replaced by a note; files of no known format get
the same treatment line by line; /proc/<pid>/cmdline argument by argument (secret-looking options in
both `--x=V` and `--x V` form and `X_TOKEN=V` arguments: `secret_arg`). The result says which files
and keys were redacted. The bundle is written 0600.

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
REMOVED = b"# content removed by driverd debug capture-host: it could not be parsed and may hold secrets\n"
# A key holds a secret when its name, lower-cased without separators, is one of these or contains
# one of the words: `password`, `x-secret-token`, `aws_secret_access_key`, `registry_token`, `apiKey`…
_SECRET_NAMES = {"auth", "authorization", "pass", "pwd", "creds", "credentials", "identitytoken"}
_SECRET_WORDS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "credential", "privatekey",
                 "accesskey", "sessionkey", "cookie")
_IDENTITY = {"username", "user", "login", "email", "serveraddress", "type", "name", "host"}
_TOML_LINE = re.compile(r'^(?P<lead>\s*(?:export\s+)?(?P<q>["\']?)(?P<key>[A-Za-z0-9_.-]+)(?P=q)\s*[=:]\s*)'
                        r'(?P<val>.+?)\s*$')
# Command-line arguments (issue 30): an option whose name, lower-cased without separators, contains one
# of these words is taken to carry a secret — `--api_key=V`, `--hf_token=V`, `--wandb_api_key V`,
# `-password V` — and so is an environment-style `NAME=V` whose NAME does (`HF_TOKEN=V`, `-e
# WANDB_API_KEY=V`, `--env=GITHUB_TOKEN=V`). Broad on purpose (`--author`, `--keyring` lose their values
# too): a debug bundle leaves the host, and an argument too many redacted costs nothing.
_ARG_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential", "auth")
_OPTION = re.compile(r"^(-{1,2})([A-Za-z0-9][A-Za-z0-9_.-]*)(?:(=)(.*))?$", re.S)
_ENV_ARG = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)=(.*)$", re.S)
_SHORT_FLAG = re.compile(r"^-[A-Za-z]$")


def secret_key(name: str) -> bool:
    n = re.sub(r"[^a-z0-9]", "", name.lower())
    return n in _SECRET_NAMES or any(w in n for w in _SECRET_WORDS)


# Kept for callers that match a whole key name.
SECRET_KEY = re.compile(r"(?i)^(auth|password|passwd|pass|identitytoken|token|secret|credentials|private_key)$")


class _Redactor:
    """Walks a parsed document (JSON, YAML, TOML through tomlkit): a non-empty scalar under a secret
    key becomes REDACTED (inside a table or list under one, every scalar does), every other string
    loses URL userinfo. `found` names what was redacted."""

    def __init__(self, dotted: bool) -> None:
        self.found: list[str] = []
        self.dotted = dotted

    def _name(self, path: str, key: str) -> str:
        return f"{path}{key}" if self.dotted else key

    def value(self, v, path: str, key: str, secret: bool):
        """The replacement for `v` (or v itself)."""
        from driverd.redact import redact as strip_userinfo
        if isinstance(v, dict):
            self.mapping(v, f"{path}{key}.", secret)
            return v
        if isinstance(v, list):
            for i, item in enumerate(list(v)):
                new = self.value(item, path, key, secret)
                if new is not item:
                    v[i] = new
            return v
        if isinstance(v, bool) or v is None:
            return v
        if secret and (isinstance(v, (int, float)) or (isinstance(v, str) and v != "")):
            self.found.append(self._name(path, key))
            return REDACTED
        if isinstance(v, str):
            clean = strip_userinfo(str(v))
            if clean != v:
                self.found.append(self._name(path, key) + " (URL userinfo)")
                return clean
        return v

    def mapping(self, d, path: str = "", secret: bool = False) -> None:
        for k in list(d.keys()):
            v = d[k]
            ks = str(k)
            # Inside a secret table (containerd's `[…registry.configs."host".auth]`, `auth = {…}`)
            # everything is a secret but the names that say whose it is.
            own = secret_key(ks) or (secret and re.sub(r"[^a-z]", "", ks.lower()) not in _IDENTITY)
            new = self.value(v, path, ks, own)
            if new is not v:
                d[k] = new


def _fmt(hostpath: str, text: str) -> str | None:
    """The format a file is parsed as: by its name, else by its content."""
    name = hostpath.rsplit("/", 1)[-1].lower()
    if name.endswith(".json") or name in ("config.json", "auth.json"):
        return "json"
    if name.endswith((".yaml", ".yml")):
        return "yaml"
    if name.endswith(".toml") or "/containerd/" in hostpath or "/crio" in hostpath or \
            "/containers/" in hostpath and name.endswith(".conf"):
        return "toml"
    if text.lstrip().startswith(("{", "[")) and not text.lstrip().startswith("[["):
        try:
            json.loads(text)
            return "json"
        except ValueError:
            pass
    return None


def secret_arg(name: str) -> bool:
    """Whether an option or environment name (`api_key`, `HF_TOKEN`, `db-password`) names a secret."""
    n = re.sub(r"[^a-z0-9]", "", name.lower())
    return any(w in n for w in _ARG_SECRET_WORDS)


def _redact_arg(t: str) -> tuple[str, str | None, bool]:
    """(the argument to keep, the name redacted or None, whether the next argument is this option's
    value)."""
    m = _OPTION.match(t)
    if m:
        dashes, name, eq, value = m.groups()
        if secret_arg(name):
            if eq:
                return (f"{dashes}{name}={REDACTED}" if value else t), (name if value else None), False
            return t, name, True                            # --name VALUE
        if eq and value:                                     # --env=NAME=VALUE
            inner, found, _ = _redact_arg(value)
            if found:
                return f"{dashes}{name}={inner}", found, False
        return t, None, False
    m = _ENV_ARG.match(t)
    if m and secret_arg(m.group(1)) and m.group(2):
        return f"{m.group(1)}={REDACTED}", m.group(1), False
    return t, None, False


def _redact_cmdline(data: bytes) -> tuple[bytes, list[str]]:
    """/proc/<pid>/cmdline, argument by argument: secret-looking options' values (both `--x=V` and
    `--x V`) and environment-style `X_TOKEN=V` become REDACTED; every URL loses its userinfo."""
    from driverd.redact import redact as strip_userinfo
    found: list[str] = []
    out: list[bytes] = []
    value_next = False
    args = data.split(b"\0")
    for i, a in enumerate(args):
        t = a.decode("utf-8", "replace")
        if value_next and t and not t.startswith("--") and not _SHORT_FLAG.match(t):
            out.append(REDACTED.encode())
            value_next = False
            continue
        value_next = False
        if i == 0:                              # the program itself
            kept, name = t, None
        else:
            kept, name, value_next = _redact_arg(t)
        if name:
            found.append(name)
        clean = strip_userinfo(kept)
        if clean != kept:
            found.append("URL userinfo")
        out.append(a if clean == t else clean.encode())
    return b"\0".join(out), found


def _redact_lines(text: str) -> tuple[str, list[str]]:
    """Files of no known format (environment files, /etc/default/*): KEY=VALUE / key: value lines
    with a secret-looking key lose their value; URLs lose their userinfo."""
    from driverd.redact import redact as strip_userinfo
    found: list[str] = []
    lines = []
    for line in text.splitlines(keepends=True):
        m = _TOML_LINE.match(line.rstrip("\n"))
        key = m.group("key").rsplit(".", 1)[-1] if m else None
        if m and key and secret_key(key) and m.group("val") not in ('""', "''"):
            lines.append(f"{m.group('lead')}\"{REDACTED}\"\n")
            found.append(m.group("key"))
            continue
        clean = strip_userinfo(line)
        if clean != line:
            found.append("URL userinfo")
        lines.append(clean)
    return "".join(lines), found


def redact(hostpath: str, data: bytes) -> tuple[bytes, list[str]]:
    """The bytes to pack for a file, with secret values replaced; and the keys redacted. JSON, YAML
    and TOML are parsed (inline tables, multi-line strings, nested lists) and written back; a file of
    one of those formats that does not parse is replaced by a note rather than copied."""
    if hostpath.startswith("/proc/"):
        return _redact_cmdline(data) if hostpath.endswith("/cmdline") else (data, [])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return data, []
    if b"PRIVATE KEY-----" in data:
        return b"# private key removed by driverd debug capture-host\n", ["private key"]
    fmt = _fmt(hostpath, text)
    if fmt is None:
        new, found = _redact_lines(text)
        return (new.encode() if found else data), found
    try:
        if fmt == "json":
            doc = json.loads(text)
            r = _Redactor(dotted=True)
            wrapped = {"": doc}
            r.mapping(wrapped)
            r.found = [f.removeprefix(".") for f in r.found]
            out = (json.dumps(wrapped[""], indent=2) + "\n") if r.found else text
        elif fmt == "yaml":
            import yaml
            docs = list(yaml.safe_load_all(text))
            r = _Redactor(dotted=True)
            wrapped = {"": docs}
            r.mapping(wrapped)
            r.found = [f.removeprefix(".") for f in r.found]
            out = yaml.safe_dump_all(wrapped[""], sort_keys=False) if r.found else text
        else:
            import tomlkit
            doc = tomlkit.parse(text)
            r = _Redactor(dotted=False)
            r.mapping(doc)
            out = tomlkit.dumps(doc) if r.found else text
    except Exception:               # noqa: BLE001  (any parser's error: the content is not packed)
        return REMOVED, [f"whole file ({fmt} that does not parse)"]
    return (out.encode() if r.found else data), r.found


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


def _resolved(root: Root, hostpath: str) -> str:
    try:
        return root.resolve(hostpath)
    except (OSError, ValueError):
        return hostpath


def _check_out(out: str) -> None:
    """--archive names a file in an existing directory this process may write: said before the host is
    read, in one line, rather than as a traceback after it."""
    from driverd.errors import UsageError
    d = os.path.dirname(os.path.abspath(out))
    fix = "pass a file in an existing, writable directory, e.g. --archive /tmp/host.tar.gz"
    if os.path.isdir(out):
        raise UsageError(f"cannot write --archive {out}: it is a directory", fix="name the file: " + fix)
    if not os.path.isdir(d):
        raise UsageError(f"cannot write --archive {out}: directory {d} does not exist", fix=fix)
    if not os.access(d, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --archive {out}: directory {d} is not writable", fix=fix)


def capture(root: Root, out: str) -> dict:
    from driverd.errors import UsageError
    from driverd.host import collect
    from driverd.host.nvml import CAPTURE_PATH
    from driverd.runtime.base import CAPTURED_VERSIONS

    _check_out(out)

    rec = Root(root.base, record=True)
    facts = collect(rec, nvml=True)
    keep_pids = {str(u.pid) for u in facts.gpu_users} | {str(p) for d in facts.daemons for p in d.pids}
    paths = sorted(rec.recorded or ())
    mtime = time.time()
    done: set[str] = set()
    files = total = 0
    redacted: list[dict] = []
    packed: set[str] = set()
    # The bundle is written 0600 from its first byte (created so, and narrowed if it existed): it
    # holds the host's configuration, redacted or not.
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise UsageError(f"cannot write --archive {out}: {e.strerror}",
                         fix="pass a file in an existing, writable directory") from None
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
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
                packed.add(hp)
                files += 1
                total += len(data)
        # Binaries are not packed; a placeholder keeps "binary present" true and their version is recorded.
        versions = {r.binary: r.version for r in facts.runtimes if r.binary}
        for b in versions:
            _add_dirs(tar, b, done, mtime)
            ti = tarfile.TarInfo(b.lstrip("/"))
            ti.mode, ti.mtime = 0o755, mtime
            tar.addfile(ti, io.BytesIO(b""))
        # So are the handlers' binaries (nvidia-container-runtime is larger than MAX_FILE): an empty file
        # with the same execute bits keeps what detect says the handler needs true in the tree.
        # (placed where the path resolves: a link to it was packed as a link).
        handler_bins = {_resolved(rec, n.binary_path): n.binary_state for r in facts.runtimes
                        if (n := r.needs) is not None and n.binary_path and n.binary_state != "missing"}
        for b, state in sorted(handler_bins.items()):
            if b in versions or b in packed:
                continue
            _add_dirs(tar, b, done, mtime)
            ti = tarfile.TarInfo(b.lstrip("/"))
            ti.mode, ti.mtime = (0o755 if state == "present" else 0o644), mtime
            tar.addfile(ti, io.BytesIO(b""))
            files += 1
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
