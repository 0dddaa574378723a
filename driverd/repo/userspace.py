"""Where the user-space package of the wanted driver version comes from, for the transaction that switches
it with the kernel modules (issue 31): `userspace.package` (one package file, or a directory of
driverd-userspace-<version>-<arch>*.tar.zst packages) first, then — with `userspace.fetch` — the
repositories' index ("userspace" entries, driverd.repo.index), fetched into the download cache and
checked against the index's size and sha256 before anything of it is decompressed (the install checks
every file against the manifest while it unpacks).

`offer()` is what the planner is told (read-only, cheap: no index is read); `fetch()` is the
fetch-userspace step."""
from __future__ import annotations

import os
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package import userspace as us
from driverd.package.archive import SUFFIX


@dataclass(frozen=True)
class Offer:
    """The user-space package for `version` this node can switch to, and what it has now."""
    version: str
    arch: str
    package: str | None        # a local package file; None: fetched from the repositories by the run
    sha256: str | None         # the local package's sha256 (None until fetched)
    source: str                # "userspace.package (PATH)" | "packages.repositories"
    current_sha: str | None    # driverd's user-space in use now (userspace.root/current), None: none
    current_version: str | None
    foreign: str | None        # a user-space driverd did not install, in front of driverd's (its library dir)
    # driverd's current tree is intact but not active: its loader configuration, PATH links or driver-root
    # link are missing or changed (after a reboot /run/nvidia/driver is gone: /run is a tmpfs)
    inactive: bool = False
    # an intact tree of `version` installed under userspace.root (the current one first): what the node
    # switches to — or makes active again — without the network when the package would come from the
    # repositories (or userspace.package is gone); None: none on disk
    installed_sha: str | None = None

    @property
    def in_place(self) -> bool:
        if self.inactive:
            return False
        if self.sha256 is not None:
            return self.current_sha == self.sha256
        return self.current_version == self.version


def _manifest(path: Path):
    from driverd.package.archive import read_manifest
    return read_manifest(path, kind=us.KIND)


def local_package(root, cfg, version: str, arch: str) -> Path | None:
    """userspace.package's package of `version`/`arch`: the file itself when its manifest says so, or in a
    directory the first (by name) whose name and manifest say so. A file of another version is not it;
    an unreadable one is a PackageError (one line: which file, why, the fix)."""
    configured = cfg["userspace.package"]
    if not configured:
        return None
    # a file or a directory of packages, resolved under the root. Root installs what it names and loads
    # its libraries into every process, so only root may be able to change it: the file, the directory
    # and every directory on the way (driverd.fsutil, as for the configuration and the keys); a refusal is
    # a ConfigError, one line with the fix.
    from driverd.fsutil import trusted_dir, trusted_file
    p = Path(configured if root.is_slash else str(root.real(configured)))
    if p.is_dir():
        p = trusted_dir(p, "userspace.package", shown=configured)
        stem = us.package_basename(version, arch)
        cands = [trusted_file(c, "userspace.package", shown=f"{configured.rstrip('/')}/{c.name}")
                 for c in sorted(p.iterdir()) if c.name.startswith(stem) and c.name.endswith(SUFFIX) and c.is_file()]
    elif p.is_file():
        cands = [trusted_file(p, "userspace.package", shown=configured)]
    else:
        raise PackageError(f"userspace.package {configured} does not exist",
                           fix="point userspace.package at a user-space package (driverd build-userspace) or a "
                               "directory of them, or unset it")
    for c in cands:
        m = _manifest(c)
        if m.driver_version == version and m.arch in (arch, {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)):
            return c
    return None


_SHA_CACHE: dict[tuple, str] = {}


def _sha(path: Path) -> str:
    """sha256 of a local package, remembered by (path, size, mtime, inode): the daemon plans every pass."""
    from driverd.package.archive import sha256_file
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _SHA_CACHE:
        if len(_SHA_CACHE) > 16:
            _SHA_CACHE.clear()
        _SHA_CACHE[key] = sha256_file(path)
    return _SHA_CACHE[key]


def offer(root, cfg, version: str | None, arch: str | None) -> Offer | None:
    """The planner's view: the package of `version` (local, or to fetch with userspace.fetch), None when
    there is none to switch to."""
    if not version:
        return None
    from driverd.driver import userspace as dus
    from driverd.driver.layout import Places
    arch = arch or os.uname().machine
    places = Places.from_config(cfg)
    cur = dus.current(root, places)
    intact = cur is not None and cur.intact
    try:
        path = local_package(root, cfg, version, arch)
        missing = None
    except PackageError as e:
        # userspace.package is gone (a removed download directory, an unmounted share): what is installed
        # of this version still brings the node back; nothing else can
        path, missing = None, e
    if path is None and not cfg["userspace.fetch"] and missing is None:
        return None
    dus.check_root(root, places)
    on_disk = None
    if path is None:
        on_disk = cur.sha if intact and cur.version == version else next(
            (t.sha for t in dus.trees(root, places) if t.intact and t.sha and t.version == version), None)
        if on_disk is None and missing is not None:
            raise missing
    foreign = dus.foreign_userspace(root, places)
    source = f"userspace.package ({path})" if path else "packages.repositories" if missing is None else \
        f"the installed tree ({missing.message})"
    return Offer(version, arch, str(path) if path else None, _sha(path) if path else None, source,
                 cur.sha if intact else None, cur.version if intact else None,
                 foreign.lib_dir if foreign is not None else None,
                 inactive=intact and cur.version == version and not dus.is_installed(root, cur.sha, places),
                 installed_sha=on_disk)


@dataclass(frozen=True)
class Fetched:
    """The user-space package found for the wanted driver version, and where it came from."""
    package: str
    sha256: str
    source: str


def fetch(root, cfg, version: str, arch: str, runner=None) -> Fetched:
    """The package of `version`/`arch`: userspace.package's, else the first repository whose index lists it,
    copied or downloaded into the cache and checked against the index (size, then sha256)."""
    from driverd.repo import fetch as f
    from driverd.package.archive import sha256_file
    from driverd.root import Root
    root = root if isinstance(root, Root) else Root(str(root))
    path = local_package(root, cfg, version, arch)
    if path is not None:
        return Fetched(str(path), sha256_file(path), f"userspace.package ({path})")
    looked: list[f.Looked] = []
    for url, idx, session in f.each_index(root, cfg, runner, looked):
        entry = idx.find_userspace(version, arch)
        if entry is None:
            looked.append(f.Looked(f.redact(url), "missing",
                                   f"its index lists {len(idx.userspace)} user-space packages, not this one"))
            continue
        return Fetched(str(f.into_cache(root, cfg, url, entry, session)), entry.sha256, f.redact(url))
    # no repository gave it: a package an earlier fetch verified and left in the cache, checked again
    hit = f.from_cache(root, f.cache_hostdir(cfg["packages.cache_dir"]), us.package_basename(version, arch),
                       files=False, kind=us.KIND)
    if hit is not None:
        return Fetched(str(hit[0]), hit[1], "cache")
    # a repository that did not answer is said as such, not as one without the user-space
    raise f.not_found(us.package_basename(version, arch), looked, None,
                      f"driverd build-userspace the {version} user-space into the repository and run `driverd repo "
                      "index REPO`, or set userspace.package", what="user-space package")
