"""A package repository: a static directory (served as-is by any HTTP server, or read via file://)
with `index.json` listing every package, optionally signed (`index.json.sig`).

index.json:
    {"schema": 1, "generated_at": "...", "serial": 1767225600, "expires": "2026-02-01T00:00:00+00:00",
     "packages": [{"driver": "535.261.03", "flavor": "open", "kernel_release": "6.1.0-47-cloud-amd64",
                   "arch": "x86_64", "sha256": "...", "size": 17123456, "path": "driverd-....tar.zst"}],
     "userspace": [{"driver": "535.261.03", "arch": "x86_64", "sha256": "...", "size": 139873560,
                    "path": "driverd-userspace-535.261.03-x86_64....tar.zst"}],
     "companions": [{"component": "fabricmanager", "driver": "550.163.01", "arch": "x86_64", "sha256": "...",
                     "size": 4123456, "path": "driverd-companion-fabricmanager-550.163.01-x86_64....tar.zst"}]}

`userspace` (present when the repository holds user-space packages, driverd.package.userspace) lists
one kernel-independent package per (driver, arch); `companions` (present when it holds companion packages,
driverd.package.companion) one per (component, driver, arch). A reader that knows only `packages` ignores
both, and an index written before either existed reads as one without them.

The signature is `openssl dgst -sha256 -sign KEY` over the exact bytes of index.json; a fetcher
configured with packages.index_public_key refuses an index whose signature is missing or wrong. Each
index entry pins a package's sha256, and each package's manifest pins every file, so one signature
covers everything a node installs. `serial` only grows and `expires` bounds the index's life: a
node refuses an older serial than it has seen, or an expired index (driverd.repo.trust).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.fsutil import atomic_write, fsync_dir
from driverd.package.archive import SUFFIX, read_manifest, sha256_file
from driverd.package.companion import KIND as COMPANION, package_basename as companion_basename
from driverd.package.manifest import package_basename
from driverd.package.userspace import KIND as USERSPACE, package_basename as userspace_basename
from driverd.repo.trust import DEFAULT_VALID_DAYS, IndexRefused
from driverd.runner import Runner

INDEX_NAME = "index.json"
SIG_NAME = "index.json.sig"
INDEX_SCHEMA = 1
_SHA_IN_NAME = re.compile(r"\.([0-9a-f]{64})\.tar\.zst$")


@dataclass(frozen=True)
class IndexEntry:
    """One kernel-module package a repository's index lists."""
    driver: str
    flavor: str
    kernel_release: str
    arch: str
    sha256: str
    size: int
    path: str                      # relative to the repository root

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.driver, self.flavor, self.kernel_release, self.arch)

    @property
    def name(self) -> str:
        return package_basename(*self.key)


@dataclass(frozen=True)
class UserspaceEntry:
    """One user-space package a repository's index lists."""
    driver: str
    arch: str
    sha256: str
    size: int
    path: str                      # relative to the repository root

    @property
    def key(self) -> tuple[str, str]:
        return (self.driver, self.arch)

    @property
    def name(self) -> str:
        return userspace_basename(*self.key)


@dataclass(frozen=True)
class CompanionEntry:
    """One companion package a repository's index lists."""
    component: str                 # fabricmanager | nscq | nvlsm | imex (driverd.package.companion.COMPONENTS)
    driver: str
    arch: str
    sha256: str
    size: int
    path: str                      # relative to the repository root

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.component, self.driver, self.arch)

    @property
    def name(self) -> str:
        return companion_basename(*self.key)


@dataclass(frozen=True)
class Index:
    """A repository's index: the packages it holds, with the serial and expiry that protect it."""
    packages: tuple[IndexEntry, ...]
    generated_at: str | None = None
    serial: int | None = None              # only grows (rollback protection)
    expires: str | None = None             # RFC 3339 (freeze protection)
    userspace: tuple[UserspaceEntry, ...] = ()
    companions: tuple[CompanionEntry, ...] = ()

    def find(self, driver: str, flavor: str, release: str, arch: str) -> IndexEntry | None:
        return next((e for e in self.packages if e.key == (driver, flavor, release, arch)), None)

    def find_userspace(self, driver: str, arch: str) -> UserspaceEntry | None:
        return next((e for e in self.userspace if e.key == (driver, arch)), None)

    def find_companion(self, component: str, driver: str, arch: str) -> CompanionEntry | None:
        return next((e for e in self.companions if e.key == (component, driver, arch)), None)

    def to_json(self) -> dict:
        out = {"schema": INDEX_SCHEMA, "generated_at": self.generated_at, "serial": self.serial,
               "expires": self.expires, "packages": [asdict(e) for e in sorted(self.packages, key=lambda e: (e.key, e.sha256))]}
        if self.userspace:
            out["userspace"] = [asdict(e) for e in sorted(self.userspace, key=lambda e: (e.key, e.sha256))]
        if self.companions:
            out["companions"] = [asdict(e) for e in sorted(self.companions, key=lambda e: (e.key, e.sha256))]
        return out


def parse_index(data: bytes | str, where: str) -> Index:
    """Validate an index: well-formed entries, safe relative paths, no cell listed with two hashes."""
    def bad(msg: str) -> PackageError:
        return PackageError(f"repository index {where}: {msg}", cause="the index is damaged or inconsistent",
                            fix="rewrite it with `driverd repo index DIR` on the repository")
    try:
        d = json.loads(data)
        if int(d.get("schema", 0)) != INDEX_SCHEMA:
            raise bad(f"unsupported schema {d.get('schema')!r}")
        entries = [IndexEntry(str(p["driver"]), str(p["flavor"]), str(p["kernel_release"]), str(p["arch"]),
                              str(p["sha256"]), int(p["size"]), str(p["path"])) for p in d["packages"]]
        us_entries = [UserspaceEntry(str(p["driver"]), str(p["arch"]), str(p["sha256"]), int(p["size"]),
                                     str(p["path"])) for p in d.get("userspace") or ()]
        cp_entries = [CompanionEntry(str(p["component"]), str(p["driver"]), str(p["arch"]), str(p["sha256"]),
                                     int(p["size"]), str(p["path"])) for p in d.get("companions") or ()]
        serial = d.get("serial")
        if serial is not None and (isinstance(serial, bool) or not isinstance(serial, int) or serial < 0):
            raise bad(f"serial {serial!r} is not a whole number")
        expires = d.get("expires")
        if expires is not None and not isinstance(expires, str):
            raise bad(f"expires {expires!r} is not a date")
    except PackageError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise bad(f"malformed ({e.__class__.__name__}: {e})") from None
    def unique(items: list) -> list:
        seen: dict[tuple, object] = {}
        out = []
        for e in items:
            if not re.fullmatch(r"[0-9a-f]{64}", e.sha256):
                raise bad(f"{e.name}: invalid sha256 {e.sha256!r}")
            parts = e.path.split("/")
            if e.path.startswith("/") or ".." in parts or "" in parts or "\\" in e.path:
                raise bad(f"{e.name}: path {e.path!r} leaves the repository")
            prev = seen.get(e.key)
            if prev is not None:
                if prev.sha256 != e.sha256:
                    raise bad(f"{e.name} is listed twice with different sha256 ({prev.sha256[:12]}… at {prev.path}, "
                              f"{e.sha256[:12]}… at {e.path})")
                continue
            seen[e.key] = e
            out.append(e)
        return out
    return Index(tuple(unique(entries)), d.get("generated_at"), serial, expires, tuple(unique(us_entries)),
                 tuple(unique(cp_entries)))


def scan(directory: str | os.PathLike, verify: bool = True) -> list[IndexEntry]:
    """The kernel-module packages DIR holds (scan_all: the user-space ones too; scan_packages: every kind)."""
    return scan_all(directory, verify)[0]


def scan_all(directory: str | os.PathLike, verify: bool = True) -> tuple[list[IndexEntry], list[UserspaceEntry]]:
    found = scan_packages(directory, verify)
    return found.packages, found.userspace


@dataclass
class Scanned:
    """The packages of a repository directory, by kind."""
    packages: list[IndexEntry]
    userspace: list[UserspaceEntry]
    companions: list[CompanionEntry]


def scan_packages(directory: str | os.PathLike, verify: bool = True) -> Scanned:
    root = Path(directory)
    out: list[IndexEntry] = []
    us_out: list[UserspaceEntry] = []
    cp_out: list[CompanionEntry] = []
    for p in sorted(root.rglob("*" + SUFFIX)):
        if any(part.startswith(".") for part in p.relative_to(root).parts):
            continue       # temp files of a pack in progress; build pods' own directories (intake.INCOMING)
        m = read_manifest(p, kind=None)
        named = _SHA_IN_NAME.search(p.name)
        sha = sha256_file(p) if verify or not named else named.group(1)
        if named and named.group(1) != sha:
            raise PackageError(f"{p.name}: content sha256 is {sha}, not the one in its name",
                               cause="the file was modified or truncated after it was built",
                               fix=f"delete {p} and rebuild it")
        rel = p.relative_to(root).as_posix()
        if getattr(m, "kind", None) == USERSPACE:
            us_out.append(UserspaceEntry(m.driver_version, m.arch, sha, p.stat().st_size, rel))
        elif getattr(m, "kind", None) == COMPANION:
            cp_out.append(CompanionEntry(m.component, m.driver_version, m.arch, sha, p.stat().st_size, rel))
        else:
            out.append(IndexEntry(m.driver_version, m.flavor, m.kernel_release, m.arch, sha, p.stat().st_size, rel))
    return Scanned(out, us_out, cp_out)


def previous_serial(directory: Path) -> int:
    try:
        s = json.loads((directory / INDEX_NAME).read_bytes()).get("serial")
        return s if isinstance(s, int) and not isinstance(s, bool) else 0
    except (OSError, ValueError, AttributeError):
        return 0


def write_index(directory: str | os.PathLike, *, sign_key: str | None = None, runner: Runner | None = None,
                verify: bool = True, valid_days: float = DEFAULT_VALID_DAYS, serial: int | None = None,
                expires: str | None = None) -> Index:
    """(Re)write DIR/index.json atomically from the packages DIR holds (and sign it when asked).
    The serial is max(previous + 1, unix time) unless given; it expires `valid_days` from now."""
    d = Path(directory)
    if not d.is_dir():
        raise PackageError(f"repository {d} is not a directory", fix="create it or pass the right path")
    found = scan_packages(d, verify)
    now = datetime.now(timezone.utc)
    if serial is None:
        serial = max(previous_serial(d) + 1, int(time.time()))
    if expires is None:
        expires = (now + timedelta(days=valid_days)).isoformat(timespec="seconds")
    idx = Index(tuple(found.packages), now.isoformat(timespec="seconds"), serial, expires, tuple(found.userspace),
                tuple(found.companions))
    data = (json.dumps(idx.to_json(), indent=2) + "\n").encode()
    parse_index(data, str(d / INDEX_NAME))      # the same checks a fetcher applies (duplicates!)
    if sign_key:
        # Sign a temp copy first so index.json and its signature change together as far as possible:
        # a reader between the two renames sees a mismatch and retries, never an unsigned index.
        fd, tmp = tempfile.mkstemp(prefix=".index.", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            sig = sign_bytes(tmp, sign_key, runner)
        finally:
            os.unlink(tmp)
        atomic_write(d / SIG_NAME, sig)
    atomic_write(d / INDEX_NAME, data)
    fsync_dir(d)
    return idx


def sign_bytes(path: str, key: str, runner: Runner | None = None) -> bytes:
    runner = runner or Runner()
    with tempfile.TemporaryDirectory(prefix="driverd-sign.") as t:
        out = os.path.join(t, "sig")
        res = runner.run(["openssl", "dgst", "-sha256", "-sign", key, "-out", out, path], timeout=60, check=False)
        if not res.ok:
            raise PackageError(f"cannot sign the index with {key}: {res.first_error_line()}",
                               fix="pass a PEM private key readable by driverd")
        return Path(out).read_bytes()


def verify_signature(data: bytes, sig: bytes | None, public_key: str, where: str,
                     runner: Runner | None = None) -> None:
    if sig is None:
        raise IndexRefused(f"repository index {where} is not signed", cause=f"{SIG_NAME} is missing",
                           fix="sign it with `driverd repo index DIR --sign-key KEY` or unset "
                               "packages.index_public_key")
    runner = runner or Runner()
    with tempfile.TemporaryDirectory(prefix="driverd-verify.") as t:
        dp, sp = os.path.join(t, "index.json"), os.path.join(t, "sig")
        Path(dp).write_bytes(data)
        Path(sp).write_bytes(sig)
        res = runner.run(["openssl", "dgst", "-sha256", "-verify", public_key, "-signature", sp, dp],
                         timeout=60, check=False, mutates=False)
    if not res.ok:
        raise IndexRefused(f"repository index {where} has a bad signature",
                           cause=f"it does not verify against {public_key}",
                           fix="check the repository and packages.index_public_key")
