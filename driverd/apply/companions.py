"""Which of the driver's companions (driverd.package.companion: fabric manager, NSCQ, NVLSM, IMEX) of version V
this host would use after the driver of V is loaded, and whether it is V's — one offer per component, made the
same way for each.

NVIDIA's fabric manager, NVLSM and IMEX refuse a driver of another version (the fabric never completes, GPU
memory is not shared across nodes), so the one started must be exactly V's. It is the first found of: driverd's
companion tree of V installed on this node (`<userspace.root>/companions/<component>/<tree>`: switched to without
the network), else — with companions.fetch — its companion package from packages.repositories (fetched by the
run; where every repository is local the plan reads their indexes and offers only what they list), else the
host's own (installed by the distribution, whose package database records its version, else its --version;
host-managed and left alone). The plan is BLOCKED before anything is unloaded when a wanted daemon's is known to
be another version, or there is none; a version it cannot tell is a warning. NSCQ is a library (how nvidia-smi
and DCGM read NVSwitches, not what CUDA needs): it is switched with the driver where driverd has it, and never
blocks — its absence is a plan warning."""
from __future__ import annotations

import re

from driverd.datatypes import dataclass
from driverd.root import Root

_UPSTREAM = re.compile(r"^(?:\d+:)?(\d+\.\d+(?:\.\d+)?)")
_VERSION_SAYS = re.compile(r"version is\s*:\s*(\d+\.\d+(?:\.\d+)?)")
_NSCQ_FILE = re.compile(r"^libnvidia-nscq\.so\.(\d+\.\d+(?:\.\d+)?)$")
# the host's library directories a distribution's libnvidia-nscq-<branch> installs into (Debian multiarch, RHEL)
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")


@dataclass(frozen=True)
class Kind:
    """What driverd knows of a companion beside its package: where the host's own is, what NVIDIA's archive and
    the distribution's package are called (how to provide it), and what turns it off."""
    component: str
    title: str                     # "fabric manager"
    tree_path: str                 # the binary in its tree (the library directory for NSCQ)
    host_path: str | None          # the host's own (None: looked for in the library directories)
    archive: str                   # NVIDIA's archive: <archive>-linux-<arch>-<version>-archive.tar.xz
    distro: str                    # the distribution's package
    key: str | None                # the setting that stops driverd wanting it
    refuses: str                   # why another version will not do
    versioned: bool = True         # the host's version is the driver's (NVLSM has its own)
    daemon: bool = True            # a daemon the plan starts (NSCQ: a library)


KINDS: dict[str, Kind] = {k.component: k for k in (
    Kind("fabricmanager", "fabric manager", "bin/nv-fabricmanager", "/usr/bin/nv-fabricmanager", "fabricmanager",
         "nvidia-fabricmanager", "daemons.fabricmanager",
         "a fabric manager of another version refuses the driver, so the fabric would never complete and the upgrade "
         "would roll back"),
    Kind("nvlsm", "NVLSM", "sbin/nvlsm", "/opt/nvidia/nvlsm/sbin/nvlsm", "nvlsm", "nvlsm", "daemons.fabricmanager",
         "NVLSM goes with the fabric manager of its driver (NVIDIA lists it in that driver's redistrib JSON): another "
         "one leaves the NVLink5 switch trays unconfigured, and the fabric manager cannot route them",
         versioned=False),
    Kind("imex", "IMEX", "bin/nvidia-imex", "/usr/bin/nvidia-imex", "nvidia_imex", "nvidia-imex", "daemons.imex",
         "an IMEX daemon of another version refuses the driver, so GPU memory would not be shared across the nodes of "
         "the NVLink domain"),
    Kind("nscq", "NSCQ", "lib", None, "libnvidia_nscq", "libnvidia-nscq", None,
         "nvidia-smi and DCGM load libnvidia-nscq of the driver's version to read the NVSwitches", daemon=False),
)}


@dataclass(frozen=True)
class CompanionSource:
    """A companion's binary (or library) and its version, with how that version is known."""
    path: str
    version: str | None
    evidence: str

    def describe(self) -> str:
        return f"{self.path} ({self.version or 'version unknown'}: {self.evidence})"


@dataclass(frozen=True)
class CompanionOffer:
    """What the plan is told of one component: driverd's of the wanted version (installed tree or package offered),
    and what the host has."""
    component: str
    version: str                                    # the driver version wanted
    ours: CompanionSource | None
    host: CompanionSource | None
    # the install-companion step's parameters that make `ours` current (None: it is current, or none)
    install: dict | None = None
    carry: str = ""                                 # what of the operator's configuration is carried over

    @property
    def kind(self) -> Kind:
        return KINDS[self.component]

    @property
    def ok(self) -> bool:
        if self.ours is not None and self.ours.version == self.version:
            return True
        return self.host is not None and self.host.version == self.version

    @property
    def source(self) -> CompanionSource | None:
        """The one that would be used after the load."""
        if self.ours is not None and self.ours.version == self.version:
            return self.ours
        return self.host or self.ours

    @property
    def known_wrong(self) -> bool:
        """What would be used is known to be of another version: it will refuse the driver."""
        if self.ok:
            return False
        src = self.ours or self.host
        return src is not None and src.version is not None

    @property
    def missing(self) -> bool:
        return self.ours is None and self.host is None

    def why_not(self) -> str:
        k, v = self.kind, self.version
        where = k.host_path or f"libnvidia-nscq.so.{v} in {', '.join(_LIB_DIRS[:2])}"
        have = self.host.describe() if self.host else f"the host has none ({where} is missing)"
        name = f"{k.archive}-linux-<arch>-{v}-archive.tar.xz" if k.versioned else \
            f"{k.archive}-linux-<arch>-<its version>-archive.tar.xz --redistrib redistrib_{v}.json"
        off = f", or set {k.key} = \"false\"" if k.key else ""
        distro = f"the distribution's {k.distro} of {v}" if k.versioned else f"the distribution's {k.distro} of driver {v}"
        return (f"no {k.title} of driver {v} is available: {have}; {k.refuses}; provide it: build the {v} companion "
                f"package (driverd build-companion {name}) into packages.repositories, or install {distro} on the "
                f"host{off}")


def host_source(root: Root, component: str) -> CompanionSource | None:
    """The host's own, with the version its package database records (dpkg, rpm), or what it says itself."""
    k = KINDS[component]
    if k.host_path is None:
        return _host_library(root)
    if not root.is_file(k.host_path):
        return None
    from driverd import distro
    for fam in distro.FAMILIES:
        owned, _note = fam.package_owners(root, [k.host_path])
        o = owned.get(k.host_path)
        if o is not None:
            m = _UPSTREAM.match(o.version or "")
            version = m.group(1) if m and k.versioned else None
            return CompanionSource(k.host_path, version,
                                   f"package {o.package} {o.version or ''} ({fam.manager})".replace("  ", " ")
                                   + ("" if k.versioned else ": NVLSM's own version, which names no driver"))
    if not k.versioned:
        return CompanionSource(k.host_path, None, "NVLSM's own version names no driver")
    return CompanionSource(k.host_path, binary_version(root, k.host_path), "its --version")


def _host_library(root: Root) -> CompanionSource | None:
    for d in _LIB_DIRS:
        for name in sorted(root.listdir(d)):
            m = _NSCQ_FILE.match(name)
            if m:
                return CompanionSource(f"{d}/{name}", m.group(1), "its file name")
    return None


def binary_version(root: Root, path: str) -> str | None:
    """What `<daemon> --version` says ("Fabric Manager version is : 550.163.01", "IMEX version is: 570.133.20");
    None when it cannot be run here or says nothing of the kind."""
    import subprocess
    try:
        res = subprocess.run([str(root.real(path)), "--version"], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "DRIVERD_SIM_ROOT": root.base})
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_SAYS.search(res.stdout or "")
    return m.group(1) if m else None


def offer(root: Root, cfg, component: str, version: str | None, arch: str | None = None) -> CompanionOffer | None:
    """None when no driver version is wanted yet. driverd's own `component` of `version`: its companion tree
    installed on this node, else — with companions.fetch — its package from packages.repositories (not offered
    when every repository is local and none lists it)."""
    if not version:
        return None
    from driverd.driver.companions import CompanionPlaces, current, of_version
    k = KINDS[component]
    places = CompanionPlaces.from_config(cfg, component)
    ours, install, carry = None, None, ""
    tree = of_version(root, places, version)
    if tree is not None:
        ours = CompanionSource(f"{places.tree(tree.name)}/{k.tree_path}", version,
                               f"driverd's companion tree {tree.sha[:12]}")
        cur = current(root, places)
        if cur is None or cur.name != tree.name or root.lexists(places.pending):
            install = {"component": component, "driver": version, "sha256": tree.sha, "installed": True}
            if component == "fabricmanager":
                from driverd.apply.fmconfig import carried
                settings, src = carried(root, places, tree, cur if cur is not None and cur.intact else None)
                carry = f"; carries {', '.join(f'{k}={v}' for k, v in settings.items())} from {src}" if settings else ""
    elif cfg["companions.fetch"] and cfg["packages.repositories"] and _may_fetch(root, cfg, component, version, arch):
        ours = CompanionSource(f"{places.current}/{k.tree_path}", version,
                               "driverd's companion package from packages.repositories, fetched by the run")
        install = {"component": component, "driver": version, "arch": arch}
        if component == "fabricmanager":
            from driverd.apply.fmconfig import in_use
            src = in_use(root, places)[0]
            carry = f"; the settings edited in {src} are carried to its configuration" if src else ""
    return CompanionOffer(component, version, ours, host_source(root, component), install, carry)


def _may_fetch(root: Root, cfg, component: str, version: str, arch: str | None) -> bool:
    import os
    from driverd.repo.companion import listed
    return listed(root, cfg, component, version, arch or os.uname().machine) is not False


def offers(root: Root, cfg, components, version: str | None, arch: str | None = None) -> dict[str, CompanionOffer]:
    """The offer of each of `components` (those the host wants), by component."""
    out = {}
    for c in components:
        o = offer(root, cfg, c, version, arch)
        if o is not None:
            out[c] = o
    return out


def companion_steps(root: Root, cfg, version: str | None) -> list[dict]:
    """The install-companion parameters that make driverd's companions of driver `version` current again from
    their installed trees — for `reload --package` and `rollback`, which name the driver by its package: one for
    each component with such a tree that is not current already."""
    if not version:
        return []
    from driverd.driver.companions import CompanionPlaces, current, of_version
    out = []
    for component in KINDS:
        places = CompanionPlaces.from_config(cfg, component)
        tree = of_version(root, places, version)
        if tree is None:
            continue
        cur = current(root, places)
        if cur is not None and cur.name == tree.name and not root.lexists(places.pending):
            continue
        out.append({"component": component, "driver": version, "sha256": tree.sha, "installed": True})
    return out
