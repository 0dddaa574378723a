"""Finding, downloading and verifying the package for a host.

Repositories are tried in the order given (https://, http://, file://, or a plain directory).
Downloads go to the cache (<root>/var/cache/driverd/packages/, content-addressed file names) through
`requests`: timeouts on connect and read, retries with exponential backoff (tenacity) on connection
errors, truncated bodies and 5xx/429, resume of a partial file with an HTTP Range request, proxies from
HTTP(S)_PROXY/NO_PROXY (requests' trust_env). A package is used only after its sha256 matches the
index and every file matches its manifest. The cache is kept under packages.cache_max_mb by removing
the least recently used packages.

Bounded before verified (issue 21): index.json and its signature are streamed with a size limit
(`MAX_INDEX_BYTES`, `MAX_SIG_BYTES`; a larger Content-Length is refused before the body is read) and
a deadline for the whole request; a package download has a deadline for all its attempts together
(`DOWNLOAD_DEADLINE_S`, not only the per-read timeout), never grows past the size the index gives,
and is checked — size, then sha256 of the compressed bytes — before anything is decompressed.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
import time
from dataclasses import field
from pathlib import Path
from typing import Callable, Iterator

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.redact import redact
from driverd.package.archive import verify_package
from driverd.package.manifest import package_basename
from driverd.repo import trust
from driverd.repo.cache import cache_hostdir, cache_name, from_cache, prune_cache
from driverd.repo.http import ATTEMPTS, CONNECT_TIMEOUT, Credentials, READ_TIMEOUT, Unreachable, _CHUNK, _Deadline, _Fatal, _Retryable, _bounded_get, _file_path, _is_file_repo, _join, _read_small_file, _retrying, _session, origin
from driverd.repo.index import INDEX_NAME, SIG_NAME, Index, IndexEntry, parse_index, verify_signature
from driverd.root import Root
from driverd.runner import Runner

_SHA_NAME = re.compile(r"[0-9a-f]{64}")
MAX_INDEX_BYTES = 32 << 20          # ~100,000 packages; a real index is far smaller
MAX_SIG_BYTES = 64 << 10            # a detached signature is a few hundred bytes
INDEX_DEADLINE_S = 120.0            # one index or signature request, all of it
DOWNLOAD_DEADLINE_S = 1800.0        # one package, all attempts: ~300 MB at 170 KB/s


@dataclass(frozen=True)
class Want:
    """The kernel-module package a host wants: one driver version and flavour for one kernel release and arch."""
    driver: str
    flavor: str
    kernel_release: str
    arch: str

    @property
    def name(self) -> str:
        return package_basename(self.driver, self.flavor, self.kernel_release, self.arch)


@dataclass
class FetchResult:
    """The package found for a host (downloaded, cached or built here) and where it came from."""
    package: Path
    sha256: str
    source: str                 # repository URL, "cache" or "local-build"
    cached: bool = False
    attempts: int = 0
    looked_in: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"package": str(self.package), "sha256": self.sha256, "source": self.source,
                "cached": self.cached, "attempts": self.attempts}


def read_index(url: str, *, public_key: str | None = None, runner: Runner | None = None, session=None,
               insecure: bool = False, root: Root | None = None, state_dir: str | None = None, now=None,
               attempts: int = ATTEMPTS) -> Index:
    """The repository's index, authentic and fresh (driverd.repo.trust): signed with
    `public_key` when one is given, else only from file:// or with `insecure`; a signed index is
    refused when expired or older than the serial this node recorded under `state_dir` (then
    recorded). Raises trust.IndexRefused for an index that must not be used."""
    where = _join(url, INDEX_NAME)
    if _is_file_repo(url):
        d = _file_path(url)
        try:
            data = _read_small_file(d / INDEX_NAME, MAX_INDEX_BYTES, "index")
            sig = _read_small_file(d / SIG_NAME, MAX_SIG_BYTES, "signature") if (d / SIG_NAME).exists() else None
        except OSError as e:
            raise PackageError(f"cannot read {d / INDEX_NAME}: {e.strerror}",
                               fix=f"run `driverd repo index {d}` or check the path") from None
    else:
        session = session or _session()
        data = _retrying(lambda: _bounded_get(session, where, MAX_INDEX_BYTES, INDEX_DEADLINE_S, "index"),
                         f"GET {where}", attempts)
        sig = _retrying(lambda: _bounded_get(session, _join(url, SIG_NAME), MAX_SIG_BYTES, INDEX_DEADLINE_S,
                                             "signature", required=False),
                        f"GET {_join(url, SIG_NAME)}", attempts) if public_key else None
    if public_key:
        verify_signature(data, sig, public_key, where, runner)
    else:
        trust.unsigned_allowed(url, _is_file_repo(url), insecure, where)
    idx = parse_index(data, where)
    if public_key:
        fp = trust.key_fingerprint(public_key, runner)
        trust.check(idx, url, where, signed=True, seen=trust.seen_serial(root, state_dir, fp), now=now, key=fp,
                    state_dir=state_dir)
        trust.record(root, state_dir, fp, url, idx)
    return idx


# -- download -----------------------------------------------------------------------------------

def each_index(root: Root, cfg, runner: Runner | None, looked: list) -> Iterator[tuple[str, Index, object]]:
    """The configured repositories' indexes, in order (packages.repositories, with the configuration's key,
    credentials — sent to the repositories' exact origins only — and trust settings): an index that cannot
    be read is noted in `looked` and skipped, one that must not be used (trust.IndexRefused) raises. Each
    comes with the HTTP session its packages are downloaded with (None for a local repository)."""
    from driverd.root.nodefiles import node_path
    repos = list(cfg["packages.repositories"])
    session = None
    creds = Credentials(node_path(root, cfg["packages.netrc"]), node_path(root, cfg["packages.auth_header_file"]))
    for url in repos:
        if not _is_file_repo(url) and session is None:
            session = _session(creds.load({o for u in repos if not _is_file_repo(u) for o in [origin(u)] if o}))
        try:
            idx = read_index(url, public_key=node_path(root, cfg["packages.index_public_key"]), runner=runner,
                             session=session, insecure=cfg["packages.insecure"], root=root,
                             state_dir=cfg["state.dir"])
        except PackageError as e:
            if isinstance(e, trust.IndexRefused):
                raise
            looked.append(Looked(redact(url), "unreachable" if isinstance(e, Unreachable) else "unusable", e.message))
            continue
        yield url, idx, session


def into_cache(root: Root, cfg, url: str, entry, session) -> Path:
    """A listed package (user-space, companion) in the download cache, checked against its index entry (size,
    then sha256) before anything of it is decompressed: the cached copy when it is intact (a damaged one is
    fetched again), else copied or downloaded. A package that does not match is never kept in the cache."""
    from driverd.package.archive import check_file
    cdir = cache_hostdir(cfg["packages.cache_dir"])
    root.makedirs(cdir)                 # only now: a refused index writes nothing
    dest = f"{cdir}/{cache_name(entry)}"
    if root.lexists(dest):
        try:
            check_file(root.real(dest), entry.sha256, entry.size)
            root.utime(dest)
            return root.real(dest)
        except PackageError:
            root.unlink(dest)           # a damaged cache entry: fetched again
    if _is_file_repo(url):
        _copy_file(url, entry, root, dest)
    else:
        download(url, entry, dest, session, root=root)
    try:
        check_file(root.real(dest), entry.sha256, entry.size)
    except PackageError as e:
        root.unlink(dest)
        raise PackageError(f"{e.message} (from {redact(url)})", cause=e.cause, fix=e.fix) from None
    return root.real(dest)


def _part(dest: str) -> str:
    d, n = dest.rsplit("/", 1)
    return f"{d}/.{n}.part"


def download(url: str, entry: IndexEntry, dest: str, session=None, attempts: int = ATTEMPTS,
             deadline_s: float = DOWNLOAD_DEADLINE_S, *, root: Root | None = None) -> int:
    """Download to the host path `dest` under `root` (via `.<name>.part`, resuming it); returns the
    number of attempts used. All attempts together finish within `deadline_s`; the file never grows
    past the index's size. Without `root`, `dest` is a path on this machine (Root("/"))."""
    import requests
    root = root or Root("/")
    dest = os.fspath(dest)
    part = _part(dest)
    src = _join(url, entry.path)
    session = session or _session()
    count = {"n": 0}
    deadline = time.monotonic() + deadline_s

    def late() -> _Fatal:
        root.unlink(part)
        return _Fatal(f"download of {src} did not finish within {deadline_s:.0f} s")

    def once() -> None:
        count["n"] += 1
        if time.monotonic() >= deadline:
            raise late()
        st = root.lstat(part)
        have = st.st_size if st is not None else 0
        if have > entry.size:
            root.unlink(part)
            have = 0
        if have == entry.size:
            return
        headers = {"Range": f"bytes={have}-"} if have else {}
        with session.get(src, headers=headers, stream=True, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT)) as r:
            if r.status_code in (500, 502, 503, 504, 429):
                raise _Retryable(f"HTTP {r.status_code}")
            if r.status_code == 416:            # our partial file is no prefix of theirs: start over
                root.unlink(part)
                raise _Retryable("HTTP 416 on resume")
            if r.status_code not in (200, 206):
                raise _Fatal(f"GET {src}: HTTP {r.status_code}")
            append = r.status_code == 206 and bool(have)
            declared = r.headers.get("Content-Length", "")
            if declared.isdigit() and (have if append else 0) + int(declared) > entry.size:
                raise _Fatal(f"{src} is {declared} bytes, the index says {entry.size}")
            with root.open_write(part, append=append) as f, _Deadline(r, deadline) as dl:
                try:
                    for chunk in r.iter_content(_CHUNK):
                        f.write(chunk)
                        if f.tell() > entry.size:         # never store more than the index promises
                            break
                except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError, AttributeError,
                        ValueError) as e:
                    f.flush()
                    if dl.fired:
                        raise late() from None
                    raise _Retryable(f"download interrupted at {f.tell()} of {entry.size} bytes ({e})") from None
                got = f.tell()
            if dl.fired:
                raise late()
        if got < entry.size:
            raise _Retryable(f"download ended at {got} of {entry.size} bytes")
        if got > entry.size:
            root.unlink(part)
            raise _Fatal(f"{src} is {got} bytes, the index says {entry.size}")

    try:
        _retrying(once, f"download of {src}", attempts)
    except _Fatal as e:
        raise PackageError(str(e), cause="the repository does not serve what its index lists",
                           fix="rewrite the repository index (driverd repo index DIR)") from None
    except OSError as e:
        raise PackageError(f"cannot write {root.path(part)}: {e.strerror}", cause=str(e),
                           fix="free space in the cache (packages.cache_dir)") from None
    root.rename(part, dest)
    return count["n"]


def _copy_file(url: str, entry: IndexEntry, root: Root, dest: str) -> None:
    src = _file_path(url) / entry.path
    part = _part(dest)
    try:
        with open(src, "rb") as fi:
            size = os.fstat(fi.fileno()).st_size
            if size != entry.size:              # size first: nothing copied, let alone decompressed
                raise PackageError(f"{src} is {size} bytes, the index says {entry.size}",
                                   cause="the repository does not serve what its index lists",
                                   fix=f"rewrite the index: driverd repo index {_file_path(url)}")
            with root.open_write(part) as fo:
                shutil.copyfileobj(fi, fo, _CHUNK)
    except FileNotFoundError:
        raise PackageError(f"{src} is listed in the index but missing", cause="the repository is incomplete",
                           fix=f"rewrite the index: driverd repo index {_file_path(url)}") from None
    except OSError as e:
        root.unlink(part)
        raise PackageError(f"cannot copy {src} into the cache: {e.strerror}",
                           fix="free space in the cache (packages.cache_dir)") from None
    root.rename(part, dest)


def _verify_into_cache(root: Root, dest: str, entry: IndexEntry, where: str, files: bool = True) -> Path:
    """Size, then sha256 of the compressed file against the index — before anything is
    decompressed — then (with `files`) every member against the manifest. Returns its real path."""
    from driverd.package.archive import check_file
    path = root.real(dest)
    try:
        st = root.lstat(dest)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise PackageError(f"{path} is not a regular file", cause="something else is in the cache's place",
                               fix=f"remove {path}")
        if files:
            verify_package(path, entry.sha256, entry.size)
        else:
            check_file(path, entry.sha256, entry.size)
    except PackageError as e:
        root.unlink(dest)                   # never keep a bad package in the cache
        raise PackageError(f"{e.message} (from {where})", cause=e.cause, fix=e.fix) from None
    return path


def fetch(root: Root, want: Want, repos: list[str], **kw) -> FetchResult:
    """The verified local package for `want`: from the cache, a repository, or a local build
    (arguments: _fetch's). Reported to driverd.observe as `package.fetch`: where it came from (a cache
    hit, or a miss served by a repository or a build), how long it took, and why it failed."""
    from driverd import observe
    stage = {"at": "index"}
    t0 = time.monotonic()
    try:
        res = _fetch(root, want, repos, _stage=stage, **kw)
    except BaseException as e:
        reason = stage["at"] if isinstance(e, PackageError) else "io" if isinstance(e, OSError) else "unexpected"
        observe.emit("package.fetch", source="none" if reason != "build" else "build", result="error",
                     cache="miss", reason=reason, seconds=time.monotonic() - t0, want=want.name)
        raise
    source = "cache" if res.cached else "build" if res.source == "local-build" else "repository"
    observe.emit("package.fetch", source=source, result="ok", cache="hit" if res.cached else "miss", reason=None,
                 seconds=time.monotonic() - t0, want=want.name, package=res.package.name)
    return res


def _fetch(root: Root, want: Want, repos: list[str], *, cache: str = "/var/cache/driverd", cache_max_mb: int = 4096,
           public_key: str | None = None, runner: Runner | None = None,
           builder: Callable[[Path], Path] | None = None, no_build_reason: str | None = None,
           attempts: int = ATTEMPTS, verify_files: bool = True, _stage: dict | None = None,
           insecure: bool = False, state_dir: str | None = None,
           credentials: Credentials | None = None) -> FetchResult:
    """verify_files=False checks only the archive's sha256 against the index; use it only when the
    package goes straight to `install(..., expected_sha256=)`, which checks every file while unpacking
    (one decompression instead of two). `_stage["at"]` says what was being done when it raised."""
    stage = _stage if _stage is not None else {}
    stage["at"] = "io"
    cdir = cache_hostdir(cache)
    looked: list[Looked] = []
    session = None
    for url in repos:
        stage["at"] = "index"
        if not _is_file_repo(url) and session is None:
            # Unreadable credentials are a configuration error, not a repository to skip.
            origins = {o for u in repos if not _is_file_repo(u) for o in [origin(u)] if o}
            session = _session((credentials or Credentials()).load(origins))
        try:
            idx = read_index(url, public_key=public_key, runner=runner, session=session, insecure=insecure,
                             root=root, state_dir=state_dir, attempts=attempts)
        except PackageError as e:
            if isinstance(e, trust.IndexRefused) or "listed twice" in e.message:
                raise                       # a tampered, stale or inconsistent index is never skipped silently
            looked.append(Looked(redact(url), "unreachable" if isinstance(e, Unreachable) else "unusable", e.message))
            continue
        entry = idx.find(want.driver, want.flavor, want.kernel_release, want.arch)
        if entry is None:
            looked.append(Looked(redact(url), "missing", f"index lists {len(idx.packages)} packages, not this one"))
            continue
        root.makedirs(cdir)                 # only now: a refused index writes nothing
        dest = f"{cdir}/{cache_name(entry)}"
        if root.lexists(dest):
            try:
                path = _verify_into_cache(root, dest, entry, "cache", verify_files)
                root.utime(dest)
                return FetchResult(path, entry.sha256, redact(url), cached=True, looked_in=[str(x) for x in looked])
            except PackageError:
                pass                        # damaged cache entry: removed, fetch it again
        n = 1
        stage["at"] = "download"
        if _is_file_repo(url):
            _copy_file(url, entry, root, dest)
        else:
            n = download(url, entry, dest, session, attempts, root=root)
        stage["at"] = "verify"
        path = _verify_into_cache(root, dest, entry, _join(url, entry.path), verify_files)
        prune_cache(root, cdir, cache_max_mb << 20, keep=cache_name(entry))
        return FetchResult(path, entry.sha256, redact(url), attempts=n, looked_in=[str(x) for x in looked])
    # No repository gave it (none configured, none answering, none listing it): a package the cache holds,
    # verified when it came and checked again now, before a build and instead of failing.
    hit = from_cache(root, cdir, want.name, verify_files)
    if hit is not None:
        return FetchResult(hit[0], hit[1], "cache", cached=True, looked_in=[str(x) for x in looked])
    if builder is not None:
        stage["at"] = "build"
        # The build writes into the cache directory as resolved inside the root (a path for the
        # build's tools); what it made is then judged and pruned through the confined writers.
        built = Path(builder(root.makedirs(cdir)))
        from driverd.package.archive import sha256_file
        real = root.real(cdir)
        if built.parent != real:
            raise PackageError(f"the local build wrote {built}, outside the cache {real}",
                               cause="the cache directory changed while the package was built",
                               fix="check who replaces packages.cache_dir; run again")
        prune_cache(root, cdir, cache_max_mb << 20, keep=built.name)
        return FetchResult(built, sha256_file(built), "local-build", looked_in=[str(x) for x in looked])
    stage["at"] = "not-found" if any(x.kind == "missing" for x in looked) or not looked else "index"
    raise not_found(want.name, looked, no_build_reason,
                    f"build it: driverd build --kernel {want.kernel_release} --flavor {want.flavor} --source SRC "
                    "--out REPO, then driverd repo index REPO")


@dataclass(frozen=True)
class Looked:
    """One repository asked for a package: `kind` unreachable (no answer: network, TLS, proxy), unusable
    (it answered, but has no index driverd can read) or missing (its index does not list the package)."""
    url: str
    kind: str
    words: str

    def __str__(self) -> str:
        return f"{self.url} ({self.words})"


def not_found(name: str, looked: list[Looked], no_build_reason: str | None, build_fix: str,
              what: str = "package") -> PackageError:
    """The error for a package no repository gave: "reachable, but not there" (build it) is kept apart
    from "could not ask" (the URL, the network, the proxy), so a connection failure is never reported
    as a missing package."""
    nobuild = f"; a local build is not possible: {no_build_reason}" if no_build_reason else ""
    if not looked:
        return PackageError(f"no {what} {name}: no repositories configured (packages.repositories / --repo)",
                            cause="there is nowhere to fetch it from" + nobuild,
                            fix=f"set packages.repositories (or pass --repo URL), or {build_fix}")
    where = "; ".join(map(str, looked))
    failed = [x for x in looked if x.kind != "missing"]
    urls = ", ".join(x.url for x in failed)
    if len(failed) == len(looked):
        one = len(failed) == 1
        if all(x.kind == "unreachable" for x in failed):
            return Unreachable(f"cannot reach the package repositor{'y' if one else 'ies'}: {where}",
                               cause=f"no repository answered, so whether one holds {name} is unknown" + nobuild,
                               fix=f"check the URL{'' if one else 's'} ({urls}), that the server is up, the network "
                                   "and the proxy settings (HTTPS_PROXY, NO_PROXY)")
        return PackageError(f"cannot read the package repositor{'y' if one else 'ies'}: {where}",
                            cause=f"no repository index could be read, so whether one holds {name} is unknown"
                                  + nobuild,
                            fix=f"check the URL{'' if one else 's'} ({urls}): a repository is a directory with the "
                                "index.json that `driverd repo index DIR` writes; check the network and proxy")
    return PackageError(f"no {what} {name} found in: {where}",
                        cause="no repository that answered holds a package for this kernel"
                              + (f" ({len(failed)} of {len(looked)} could not be read)" if failed else "") + nobuild,
                        fix=build_fix + (f"; check {urls}" if failed else ""))


def sha256_of(path: str | os.PathLike) -> str:
    from driverd.package.archive import sha256_file
    return sha256_file(path)


def want_for_host(root: Root, cfg, kernel: str | None = None, arch: str | None = None) -> Want:
    """The package this host needs: driver from config, kernel release and arch from the host's
    facts (or given), flavour from config or — for auto — the same decision `driverd plan` makes."""
    from driverd.errors import UsageError
    from driverd.host.kernel import read_kernel
    version = cfg["driver.version"]
    if not version:
        raise UsageError("no driver version", cause="neither --driver nor driver.version is set",
                         fix="pass --driver VERSION or set driver.version")
    k = read_kernel(root, [])
    release, arch = kernel or k.release, arch or k.arch
    if not release:
        raise UsageError("kernel release unknown", cause="no --kernel and no /proc/sys/kernel/osrelease under "
                         "the root", fix="pass --kernel RELEASE")
    if not arch:
        raise UsageError("kernel architecture unknown", cause="no /proc/sys/kernel/arch under the root and the "
                         "release does not name it", fix="pass --arch")
    flavor = cfg["driver.flavor"]
    if flavor == "auto":
        from driverd.host import collect
        from driverd.plan.flavor import decide
        flavor = decide(collect(root, nvml=False).gpus, version, "auto").flavor
        if flavor is None:
            raise UsageError("flavour auto: this host has no NVIDIA GPU to decide from", fix="pass --flavor")
    return Want(version, flavor, release, arch)
