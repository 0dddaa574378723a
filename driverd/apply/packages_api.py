"""The executor's view of the packages subject: fetch a package for (driver, flavour, kernel, arch).

driverd.packages.fetch does the real work (index, download, cache, verification). Until that module
is part of this build, a file:// repository directory is searched for a package whose manifest
matches, which is what the demo's shipped repository is.
"""
from __future__ import annotations

import os
from pathlib import Path

from driverd.errors import PackageError


def fetch(ctx, params: dict) -> str:
    cfg = ctx.config
    repos = list(cfg["packages.repositories"])
    try:
        from driverd.packages.fetch import Want, fetch as pkg_fetch
    except ImportError:
        pkg_fetch = None
    if pkg_fetch is not None:
        res = pkg_fetch(ctx.root, Want(params["driver"], params["flavor"], params["kernel"], params.get("arch") or "x86_64"),
                        repos, cache=cfg["packages.cache_dir"], cache_max_mb=cfg["packages.cache_max_mb"],
                        public_key=cfg["packages.index_public_key"], runner=ctx.runner)
        return str(res.package)
    from driverd.packages.archive import read_manifest
    looked = []
    for url in repos:
        if not url.startswith("file://"):
            continue
        d = Path(url[len("file://"):])
        looked.append(str(d))
        for p in sorted(d.glob("*.tar.zst")) if d.is_dir() else []:
            try:
                m = read_manifest(p)
            except PackageError:
                continue
            if (m.driver_version, m.flavor, m.kernel_release) == (params["driver"], params["flavor"], params["kernel"]):
                return os.fspath(p)
    raise PackageError(f"no package for {params['driver']} ({params['flavor']}) kernel {params['kernel']}",
                       cause="looked in " + (", ".join(looked) or "no repository (packages.repositories is empty)"),
                       fix="add a repository holding it to packages.repositories, or build one (driverd build)")
