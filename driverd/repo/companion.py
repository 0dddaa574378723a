"""Where a companion package (driverd.package.companion: fabric manager, nscq, NVLSM or IMEX of one driver
version) comes from, for the installer that puts the loaded driver's companions on an NVSwitch/NVLink node — the
same sources, in the same order and with the same checks, as the user-space package's (driverd.repo.userspace):

- `in_index(index, component, version, arch)`: an index's entry ("companions", driverd.repo.index), or None;
- `in_directory(directory, component, version, arch)`: the package a directory of packages holds — found by its
  name (driverd-companion-<component>-<version>-<arch>.<sha256>.tar.zst) and then its manifest — or None;
- `fetch(root, cfg, component, version, arch, directory=...)`: that directory's package, else the first of
  packages.repositories whose index lists it, copied or downloaded into the download cache and checked against
  the index's size and sha256 before anything of it is decompressed, else one an earlier fetch left in the
  cache (checked again); a PackageError, one line, when none has it.

Root installs what these name and runs it, so a directory of packages and each package in it must be root's
and not writable by others (driverd.fsutil.trusted_dir / trusted_file, as for userspace.package)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package import companion as cp
from driverd.package.archive import SUFFIX
from driverd.repo.index import CompanionEntry, Index

if TYPE_CHECKING:                   # names for the signatures only: no import at run time
    from driverd.config import Config
    from driverd.root import Root
    from driverd.runner import Runner

# a node's uname and Debian's names for the same arch
_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def _arch(arch: str) -> str:
    return _ARCH_ALIASES.get(arch, arch)


def _known(component: str) -> cp.Component:
    try:
        return cp.COMPONENTS[component]
    except KeyError:
        raise PackageError(f"unknown companion component {component!r}",
                           fix=f"ask for one of {', '.join(cp.COMPONENTS)}") from None


@dataclass(frozen=True)
class Found:
    """A companion package on this machine, ready for the install (which checks every file against the manifest
    while it unpacks: driverd.package.archive.unpack_at(..., kind="companion"))."""
    component: str
    version: str
    arch: str
    package: str               # its real path
    sha256: str
    source: str                # "DIR", a repository's URL (credentials redacted), or "cache"

    def to_json(self) -> dict:
        return {"component": self.component, "driver": self.version, "arch": self.arch, "package": self.package,
                "sha256": self.sha256, "source": self.source}


def in_index(index: Index, component: str, version: str, arch: str) -> CompanionEntry | None:
    """The index's companion package of (component, driver version, arch); None when it lists none."""
    _known(component)
    return index.find_companion(component, version, _arch(arch))


def in_directory(directory: str | Path, component: str, version: str, arch: str, *,
                 shown: str | None = None) -> Path | None:
    """The first package (by name) of `directory` whose name and manifest say (component, version, arch); None
    when it holds none. A directory or package others could change is a ConfigError; an unreadable package of
    that name a PackageError (one line each: which file, why, the fix)."""
    from driverd.fsutil import trusted_dir, trusted_file
    from driverd.package.archive import read_manifest
    _known(component)
    arch = _arch(arch)
    shown = shown or str(directory)
    d = trusted_dir(directory, "companion package directory", shown=shown)
    assert d is not None
    stem = cp.package_basename(component, version, arch)
    for c in sorted(d.iterdir()):
        if not (c.name.startswith(stem + ".") and c.name.endswith(SUFFIX) and c.is_file()):
            continue
        real = trusted_file(c, "companion package", shown=f"{shown.rstrip('/')}/{c.name}")
        assert real is not None
        m = read_manifest(real, kind=cp.KIND)
        if (m.component, m.driver_version, m.arch) == (component, version, arch):
            return real
    return None


def fetch(root: "Root | str", cfg: "Config", component: str, version: str, arch: str, *,
          directory: str | None = None, runner: "Runner | None" = None) -> Found:
    """The companion package of (component, version, arch) on this machine: `directory`'s (a host path under
    the root), else the repositories', else the cache's (module docstring)."""
    from driverd.package.archive import sha256_file
    from driverd.repo import fetch as f
    from driverd.root import Root
    _known(component)
    arch = _arch(arch)
    root = root if isinstance(root, Root) else Root(str(root))
    name = cp.package_basename(component, version, arch)
    if directory:
        local = in_directory(Path(directory if root.is_slash else str(root.real(directory))), component, version,
                             arch, shown=directory)
        if local is not None:
            return Found(component, version, arch, str(local), sha256_file(local), directory)
    looked: list[f.Looked] = []
    for url, idx, session in f.each_index(root, cfg, runner, looked):
        entry = idx.find_companion(component, version, arch)
        if entry is None:
            looked.append(f.Looked(f.redact(url), "missing",
                                   f"its index lists {len(idx.companions)} companion packages, not this one"))
            continue
        path = f.into_cache(root, cfg, url, entry, session)
        return Found(component, version, arch, str(path), entry.sha256, f.redact(url))
    hit = f.from_cache(root, f.cache_hostdir(cfg["packages.cache_dir"]), name, files=False, kind=cp.KIND)
    if hit is not None:
        return Found(component, version, arch, str(hit[0]), hit[1], "cache")
    raise f.not_found(name, looked, None,
                      f"driverd build-companion NVIDIA's {component} archive of {version} into the repository and run "
                      "`driverd repo index REPO`", what="companion package")


def listed(root: "Root", cfg: "Config", component: str, version: str, arch: str) -> bool | None:
    """Whether a fetch of the companion package (component, version, arch) can succeed, as far as this can be told
    without the network — for the plan, which is then blocked (or, for what never blocks, warns) before anything
    changes instead of failing at the install after the unload: True when the download cache holds it or one of the
    repositories' indexes lists it, False when every repository is a local one (file://) and none lists it (or
    none is configured), None when a network repository may (its fetch says). Writes nothing."""
    from driverd.repo.cache import cache_hostdir, cached_candidates
    from driverd.repo.fetch import read_index
    from driverd.repo.http import _is_file_repo
    from driverd.root.nodefiles import node_path
    arch = _arch(arch)
    if cached_candidates(root, cache_hostdir(cfg["packages.cache_dir"]), cp.package_basename(component, version, arch)):
        return True
    repos = list(cfg["packages.repositories"])
    if not all(_is_file_repo(u) for u in repos):
        return None
    for url in repos:
        try:
            idx = read_index(url, public_key=node_path(root, cfg["packages.index_public_key"]),
                             insecure=cfg["packages.insecure"], root=root, state_dir=None)
        except PackageError:
            return None             # unreadable or refused: the fetch step says why
        if idx.find_companion(component, version, arch) is not None:
            return True
    return False
