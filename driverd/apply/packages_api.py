"""The executor's view of the packages subject: fetch a package for (driver, flavour, kernel, arch)
from the configured repositories, or built locally when none has it and the host can
(driverd.packages.fetch does the index, download, cache, verify and the build fallback)."""
from __future__ import annotations


def fetch(ctx, params: dict) -> str:
    from driverd.packages.fetch import Want, fetch_configured
    want = Want(params["driver"], params["flavor"], params["kernel"], params.get("arch") or "x86_64")
    return str(fetch_configured(ctx.root, ctx.config, want, runner=ctx.runner).package)
