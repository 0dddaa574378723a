"""The build host's distribution family: where its kernel headers and kbuild trees live and which
packages provide them (the hints a failed build prints). From os-release under the root; a family
without build knowledge gets driverd.distro.DEFAULT's (driverd's builds are made on Debian)."""
from __future__ import annotations

from driverd import distro
from driverd.root import Root


def family(root: Root) -> distro.Distro:
    from driverd.host.osrelease import read_os
    os_ = read_os(root, [])
    return distro.for_build(os_.id, os_.id_like)
