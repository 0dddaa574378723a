"""Which fabric manager would start after the driver of version V is loaded, and whether it is V's.

On NVSwitch hosts CUDA cannot use a GPU until a fabric manager of exactly the loaded driver's version has
configured the fabric; one of another version refuses to start ("... don't match with driver version ...").
The daemon started is the first found of: driverd's companion tree of the driver (`<userspace.root>/
companions/fabricmanager/current/bin`, install/companion.py), driverd's user-space tree, the host's
/usr/bin/nv-fabricmanager (host-managed: installed by the distribution, whose version its package database
records, and left alone). The plan is BLOCKED before anything is unloaded when none of them is V's."""
from __future__ import annotations

import re
from dataclasses import dataclass

from driverd.root import Root

HOST_BINARY = "/usr/bin/nv-fabricmanager"
_UPSTREAM = re.compile(r"^(?:\d+:)?(\d+\.\d+(?:\.\d+)?)")
_VERSION_SAYS = re.compile(r"version is\s*:\s*(\d+\.\d+(?:\.\d+)?)")


@dataclass(frozen=True)
class FabricManagerSource:
    """A fabric manager binary and its version, with how that version is known."""
    path: str
    version: str | None
    evidence: str

    def describe(self) -> str:
        return f"{self.path} ({self.version or 'version unknown'}: {self.evidence})"


@dataclass(frozen=True)
class FabricManagerOffer:
    """What the plan is told: the fabric manager of the wanted version driverd can start, else what the host has."""
    version: str                                    # the driver version wanted
    ours: FabricManagerSource | None                # driverd's companion (installed tree or package offered)
    host: FabricManagerSource | None                # the host's own
    # the install-companion step's parameters that make `ours` current (None: it is current, or none)
    install: dict | None = None
    carry: str = ""                                 # what of the operator's configuration is carried over

    @property
    def ok(self) -> bool:
        if self.ours is not None and self.ours.version == self.version:
            return True
        return self.host is not None and self.host.version == self.version

    @property
    def known_wrong(self) -> bool:
        """The fabric manager that would start is known to be of another version: it will refuse the driver."""
        if self.ok:
            return False
        src = self.ours or self.host
        return src is not None and src.version is not None

    def why_not(self) -> str:
        have = self.host.describe() if self.host else f"the host has none ({HOST_BINARY} is missing)"
        return (f"no fabric manager of driver {self.version} is available: {have}; a fabric manager of another "
                f"version refuses the driver, so the fabric would never complete and the upgrade would roll back; "
                f"provide it: build the {self.version} companion package (driverd build-companion "
                f"fabricmanager-linux-<arch>-{self.version}-archive.tar.xz) into packages.repositories, or install "
                f"the distribution's nvidia-fabricmanager of {self.version} on the host, or set "
                f"daemons.fabricmanager = \"false\"")


def host_fabricmanager(root: Root) -> FabricManagerSource | None:
    """The host's own fabric manager, with the version its package database records (dpkg, rpm), or, for
    driverd's simulated hosts, the version its stand-in was written for."""
    if not root.is_file(HOST_BINARY):
        return None
    from driverd import distro
    for fam in distro.FAMILIES:
        owned, _note = fam.package_owners(root, [HOST_BINARY])
        o = owned.get(HOST_BINARY)
        if o is not None:
            m = _UPSTREAM.match(o.version or "")
            return FabricManagerSource(HOST_BINARY, m.group(1) if m else None,
                                       f"package {o.package} {o.version or ''} ({fam.manager})".replace("  ", " "))
    return FabricManagerSource(HOST_BINARY, binary_version(root, HOST_BINARY), "its --version")


def binary_version(root: Root, path: str) -> str | None:
    """What `nv-fabricmanager --version` says ("Fabric Manager version is : 550.163.01"); None when it cannot
    be run here or says nothing of the kind."""
    import subprocess
    try:
        res = subprocess.run([str(root.real(path)), "--version"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "DRIVERD_SIM_ROOT": root.base})
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_SAYS.search(res.stdout or "")
    return m.group(1) if m else None


def offer(root: Root, cfg, version: str | None, arch: str | None = None) -> FabricManagerOffer | None:
    """None when no driver version is wanted yet. driverd's own fabric manager of `version`: its companion
    tree installed on this node (switched to without the network), else — with companions.fetch — its
    companion package from packages.repositories, fetched by the run (companions.fetch)."""
    if not version:
        return None
    from driverd.driver.companions import CompanionPlaces, current, of_version
    places = CompanionPlaces.from_config(cfg, "fabricmanager")
    ours, install, carry = None, None, ""
    tree = of_version(root, places, version)
    if tree is not None:
        ours = FabricManagerSource(f"{places.tree(tree.name)}/bin/nv-fabricmanager", version,
                                   f"driverd's companion tree {tree.sha[:12]}")
        cur = current(root, places)
        if cur is None or cur.name != tree.name or root.lexists(places.pending):
            install = {"component": "fabricmanager", "driver": version, "sha256": tree.sha, "installed": True}
            from driverd.apply.fmconfig import carried
            settings, src = carried(root, places, tree, cur if cur is not None and cur.intact else None)
            carry = f"; carries {', '.join(f'{k}={v}' for k, v in settings.items())} from {src}" if settings else ""
    elif cfg["companions.fetch"] and cfg["packages.repositories"]:
        ours = FabricManagerSource(f"{places.current}/bin/nv-fabricmanager", version,
                                   "driverd's companion package from packages.repositories, fetched by the run")
        install = {"component": "fabricmanager", "driver": version, "arch": arch}
        from driverd.apply.fmconfig import in_use
        src = in_use(root, places)[0]
        carry = f"; the settings edited in {src} are carried to its configuration" if src else ""
    return FabricManagerOffer(version, ours, host_fabricmanager(root), install, carry)


def companion_step(root: Root, cfg, version: str | None) -> dict | None:
    """The install-companion parameters that make driverd's fabric manager of driver `version` current
    again from its installed tree — for `reload --package` and `rollback`, which name the driver by its
    package: None when there is no such tree, or it is current already."""
    if not version:
        return None
    from driverd.driver.companions import CompanionPlaces, current, of_version
    places = CompanionPlaces.from_config(cfg, "fabricmanager")
    tree = of_version(root, places, version)
    if tree is None:
        return None
    cur = current(root, places)
    if cur is not None and cur.name == tree.name and not root.lexists(places.pending):
        return None
    return {"component": "fabricmanager", "driver": version, "sha256": tree.sha, "installed": True}
