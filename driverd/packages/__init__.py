"""Precompiled driver packages: format + manifest, build from source, sign, repository index, fetch,
verify, install. One package = one (driver version, flavour, kernel release, arch)."""
