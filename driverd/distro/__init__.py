"""Distribution families: what differs between Debian-like and RPM-based hosts, one module each.

    from driverd import distro
    fam = distro.choose(os_facts.id, os_facts.id_like)     # Debian(), Rpm() or None

`FAMILIES` is the one explicit table (in the order a host's tools and databases are tried); nothing
registers itself on import. A family is a `base.Distro` subclass. This package sits low in the
layers: host/, kmod/ and packages/ import it; it imports only driverd.root.
"""
from __future__ import annotations

from driverd.distro.base import Distro, Owned
from driverd.distro.debian import Debian
from driverd.distro.rpm import Rpm

FAMILIES: tuple[Distro, ...] = (Debian(), Rpm())
# The family whose build knowledge driverd uses when the build host's own family has none (driverd's
# builds are made and tested on Debian): kernel-header hints, build tools, the build matrix's default.
DEFAULT: Distro = FAMILIES[0]


def choose(os_id: str, id_like: tuple[str, ...]) -> Distro | None:
    """The family os-release(5) names: the one whose ids hold ID, else the first ID_LIKE value a
    family holds (ID_LIKE lists the closest first); None when no family knows the host."""
    for value in (os_id, *id_like):
        fam = next((f for f in FAMILIES if value in f.ids), None)
        if fam is not None:
            return fam
    return None


def for_build(os_id: str | None = None, id_like: tuple[str, ...] = ()) -> Distro:
    """The family whose build dependencies a build on this host names: its own when it has build
    knowledge, DEFAULT otherwise."""
    fam = choose(os_id, id_like) if os_id else None
    return fam if fam is not None and fam.headers_package is not None else DEFAULT


__all__ = ["Distro", "Owned", "FAMILIES", "DEFAULT", "choose", "for_build"]
