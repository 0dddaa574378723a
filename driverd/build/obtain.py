"""The package for a host, from wherever it can come: a configured repository, the download cache, or —
when packages.build_fallback allows and the kernel's headers are there — this host's own build."""
from __future__ import annotations

from driverd.build.modules import cannot_build, local_builder
from driverd.repo.cache import cache_hostdir, cached_candidates
from driverd.repo.fetch import FetchResult, Want, fetch
from driverd.repo.http import Credentials
from driverd.root import Root
from driverd.root.nodefiles import node_path
from driverd.runner import Runner


def fetch_configured(root: Root, cfg, want: Want, repos: list[str] | None = None, *, runner: Runner | None = None,
                     allow_build: bool = True, verify_files: bool = True) -> FetchResult:
    """fetch() with everything taken from driverd's configuration, including the decision whether
    this host may build the package itself when no repository has it (packages.build_fallback)."""
    builder, reason = None, "disabled (--no-build or packages.build_fallback=false)"
    if allow_build and cfg["packages.build_fallback"]:
        builder, reason = local_builder(root, cfg, want, runner or Runner())
    creds = Credentials(node_path(root, cfg["packages.netrc"]), node_path(root, cfg["packages.auth_header_file"]))
    return fetch(root, want, list(repos if repos is not None else cfg["packages.repositories"]),
                 cache=cfg["packages.cache_dir"], cache_max_mb=cfg["packages.cache_max_mb"],
                 public_key=node_path(root, cfg["packages.index_public_key"]), runner=runner, builder=builder,
                 no_build_reason=reason, verify_files=verify_files, insecure=cfg["packages.insecure"],
                 state_dir=cfg["state.dir"], credentials=creds)


def unavailable(root: Root, cfg, release: str | None, want: Want | None = None) -> str | None:
    """Why no package for `release` can come from anywhere — no repository is configured, the download
    cache holds no package for `want` (what `driverd fetch --repo file:///media/...` leaves on an air-gapped
    host) and this host cannot build it (packages.build_fallback, packages.source, the kernel's headers) —
    or None when a fetch may succeed. The plan is blocked on it rather than fail at fetch-package."""
    if not release:
        return None
    missing = None
    if cfg["packages.repositories"]:
        missing = _not_listed(root, cfg, want)
        if missing is None:
            return None
    if want is not None and cached_candidates(root, cache_hostdir(cfg["packages.cache_dir"]), want.name):
        return None
    if not cfg["packages.build_fallback"]:
        why = "packages.build_fallback = false"
    else:
        why = cannot_build(root, cfg, release)
    if why is None:
        return None
    return f"{missing} and no local build: {why}" if missing else \
        f"no repository is configured (packages.repositories) and no local build: {why}"


def _not_listed(root: Root, cfg, want: Want | None) -> str | None:
    """Where the repositories are all local (file://: read without the network), that none of their indexes
    lists `want` — `plan --driver` of a version nobody built said it would run. None: one lists it, or it
    cannot be told here (a network repository: the fetch step says; an index that cannot be read or is
    refused: the fetch step says why). Writes nothing (the index's serial is recorded by the fetch)."""
    from driverd.errors import PackageError
    from driverd.repo.fetch import _is_file_repo, read_index
    from driverd.redact import redact
    repos = list(cfg["packages.repositories"])
    if want is None or not all(_is_file_repo(u) for u in repos):
        return None
    said = []
    for url in repos:
        try:
            idx = read_index(url, public_key=node_path(root, cfg["packages.index_public_key"]),
                             insecure=cfg["packages.insecure"], root=root, state_dir=None)
        except PackageError:
            return None
        if idx.find(want.driver, want.flavor, want.kernel_release, want.arch) is not None:
            return None
        said.append(f"{redact(url)} lists {len(idx.packages)} packages, not this one")
    return f"no repository lists {want.name} ({'; '.join(said)})"
