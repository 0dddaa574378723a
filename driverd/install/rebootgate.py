"""The reboot gate (issue 43): may this node reboot without coming back with no GPU driver?

Open when every installed kernel the boot loader would start instead of the running one — every release newer
than it (driverd.host.kernels: the family's boot images and package database) — has a driverd package of the
node's driver installed and verified:
- the package's manifest names the driver (version, flavour) the node runs, its install record and every
  module file are there and of their recorded size (driverd.install.records.is_installed: what an install
  verified against the manifest's sha256s), and no install into that tree is pending;
- every module's vermagic, read from the .ko itself, is that kernel's (its release, and the whole string its
  own modules carry);
- where that kernel enforces module signatures (its /boot/config's CONFIG_MODULE_SIG_FORCE, the boot command
  line's module.sig_enforce, lockdown, or Secure Boot with a kernel that locks down under it), every module
  is signed by a key the keyrings trust (the running kernel's keyrings: the platform and machine (MOK)
  keyrings are the firmware's and the same for every kernel; a builtin key another kernel was built with
  cannot be read before it runs) or that signing.trusted_certs declares.
Closed otherwise, naming each kernel, what it lacks and the fix; also closed for a kernel whose own
installation is unfinished (driverd.host.kernels' problems). Read-only and quick: it runs every kured period.

The driver "the node runs": `--driver`, else the driver driverd last converged it to in cluster mode
(driver.state's record of the last converge: in a cluster a rollout pins it), else driver.version; the flavour likewise, for `auto` the
installed package's of the running kernel or the GPUs' decision."""
from __future__ import annotations

import os
import time
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.driver.state import DriverState
from driverd.host.kernels import InstalledKernel, family, installed_kernels, newer_than
from driverd.host.kernel import running_release
from driverd.driver.ident import VERSION_FILE
from driverd.driver.records import read_json
from driverd.driver.layout import MODULES_DIR as INSTALL_DIR

DAEMON_STATE = "/run/driverd/daemon.json"   # driverd.apply.statefile: the daemon's kernel preparations


@dataclass
class KernelVerdict:
    """The reboot gate's verdict on one installed kernel: whether the node's driver is ready for it."""
    release: str
    ready: bool
    short: str = ""                 # "no package, no headers to build"; "" when ready
    lacks: list[str] = field(default_factory=list)
    fix: str | None = None
    package: dict | None = None     # the driverd package installed for it: version, flavor, sha256
    headers: bool = False
    daemon: dict | None = None      # the daemon's last preparation of it (state, reason, next try)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def line(self) -> str:
        if self.ready:
            p = self.package or {}
            return f"kernel {self.release}: ready (driverd package {p.get('version')} ({p.get('flavor')}) installed " \
                   "and verified)"
        out = f"kernel {self.release}: {self.short}: " + "; ".join(self.lacks)
        if self.daemon and self.daemon.get("reason"):
            out += f"; the daemon's last attempt: {self.daemon['reason']}"
        return out + (f"; fix: {self.fix}" if self.fix else "")


@dataclass
class Gate:
    """The reboot gate: whether this node may reboot without coming back with no GPU driver, and why."""
    ready: bool
    running: str | None
    driver: dict | None             # {"version", "flavor", "source"} judged against
    kernels: list[KernelVerdict]
    reason: str                     # one line: why it is open or closed
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"ready": self.ready, "running": self.running, "driver": self.driver, "reason": self.reason,
                "kernels": [k.to_json() for k in self.kernels], "seconds": round(self.seconds, 4)}

    def text(self) -> str:
        head = ("reboot-ready: yes, " if self.ready else "reboot-ready: no, ") + self.reason
        return "\n".join([head] + [f"  {k.line()}" for k in self.kernels])


def wanted_driver(root, cfg, version: str | None = None, flavor: str | None = None) -> dict | None:
    """{"version", "flavor", "source"} of the driver the node runs after a reboot; None: none is named."""
    source = "--driver"
    if not version:
        last = DriverState(root, state_dir=cfg["state.dir"]).last_converged()
        if last is not None:
            version, source = last.version, "the driver the node last converged to"
            flavor = flavor or last.flavor or None
        elif cfg["driver.version"]:
            version, source = cfg["driver.version"], "driver.version"
    if not version:
        return None
    flavor = flavor or (cfg["driver.flavor"] if cfg["driver.flavor"] != "auto" else None)
    if flavor is None:
        flavor = _flavor_of_running(root, version) or _flavor_of_gpus(root, version)
    return {"version": version, "flavor": flavor, "source": source}


def _flavor_of_running(root, version: str) -> str | None:
    from driverd.driver.kept import tree_manifest
    rel = running_release(root)
    m = tree_manifest(root.real(f"/lib/modules/{rel}/{INSTALL_DIR}")) if rel else None
    return m.flavor if m is not None and m.driver_version == version else None


def _flavor_of_gpus(root, version: str) -> str | None:
    from driverd.host import pci
    from driverd.plan.flavor import decide
    gpus, _, _ = pci.classify(root, pci.scan(root, []), [])
    return decide(gpus, version, "auto").flavor if gpus else None


def has_gpus(root) -> bool:
    """An NVIDIA GPU on the PCI bus (vendor and class only: the GPU table is not needed to know it)."""
    from driverd.host import pci
    return any(d.vendor == pci.NVIDIA and d.class_code in pci.GPU_CLASSES for d in pci.scan(root, []))


def judge(root, cfg, *, version: str | None = None, flavor: str | None = None) -> Gate:
    t0 = time.monotonic()
    g = _judge(root, cfg, version, flavor)
    g.seconds = time.monotonic() - t0
    return g


def _judge(root, cfg, version, flavor) -> Gate:
    running = running_release(root)
    if running is None:
        return Gate(False, None, None, [], "the running kernel's release is unknown (/proc/sys/kernel/osrelease "
                    "unreadable): nothing can be compared; fix: run on the host, or with --root at its root")
    fam = family(root)
    newer = newer_than(installed_kernels(root, fam), running, fam)
    if cfg["driver.manage"] == "never":
        return Gate(True, running, None, [], "driver.manage = never: driverd does not provide the driver")
    if not has_gpus(root):
        return Gate(True, running, None, [], "no NVIDIA GPU on this host: no driver to come back with")
    if cfg["driver.manage"] == "auto" and root.lexists(VERSION_FILE) and \
            not root.lexists(f"/lib/modules/{running}/{INSTALL_DIR}/manifest.json"):
        # a driver runs that driverd did not install (a distribution's or DKMS package): driver.manage = auto
        # leaves it to its package manager, which rebuilds it for a new kernel (DKMS) or not — not driverd's gate
        return Gate(True, running, None, [], "the running NVIDIA driver is not driverd's (no driverd package for "
                    f"{running}; driver.manage = auto leaves it to its package manager)")
    want = wanted_driver(root, cfg, version, flavor)
    if want is None:
        return Gate(False, running, None, [], "no driver is named (driver.version is not set and the node has no "
                    "recorded driver); fix: set driver.version, or pass --driver VERSION")
    if not newer:
        return Gate(True, running, want, [], f"no kernel newer than the running {running} is installed")
    verdicts = [judge_kernel(root, cfg, fam, k, want) for k in newer]
    bad = [v for v in verdicts if not v.ready]
    if bad:
        why = "; ".join(f"{v.release}: {v.short}" for v in bad)
        return Gate(False, running, want, verdicts, f"{len(bad)} of {len(verdicts)} newer kernel(s) would boot "
                    f"without the {want['version']} ({want['flavor']}) driver ({why})")
    return Gate(True, running, want, verdicts, f"every newer kernel ({', '.join(v.release for v in verdicts)}) has "
                f"the {want['version']} ({want['flavor']}) driver installed and verified")


def _headers(root, fam, release: str) -> bool:
    return any(root.is_file(f"{d}/Makefile") for d in (f"/lib/modules/{release}/build", *fam.headers_for(release)))


def _daemon_record(root, release: str) -> dict | None:
    doc = read_json(root, DAEMON_STATE) or {}
    kernels = doc.get("kernels") if isinstance(doc.get("kernels"), dict) else {}
    rec = kernels.get(release)
    return rec if isinstance(rec, dict) else None


def judge_kernel(root, cfg, fam, k: InstalledKernel, want: dict) -> KernelVerdict:
    """One newer kernel against the node's driver `want` (the module docstring's rules)."""
    from driverd.install.records import is_installed
    from driverd.driver.kept import tree_manifest, tree_sha
    rel = k.release
    v = KernelVerdict(rel, False, headers=_headers(root, fam, rel), daemon=_daemon_record(root, rel))
    shorts, fixes = [], []
    for p in k.problems:                       # the kernel's own installation, unfinished
        what, _, fix = p.partition("; fix: ")
        v.lacks.append(what)
        fixes.append(fix)
    if k.problems:
        shorts.append("kernel not completely installed")
    tree = f"/lib/modules/{rel}/{INSTALL_DIR}"
    d = root.real(tree)
    m = tree_manifest(d)
    prepare = f"driverd prepare-kernel {rel} (the daemon does it within one pass)"
    headers_pkg = fam.headers_package.format(release=rel) if fam.headers_package else "its kernel headers"
    if m is None:
        shorts.append("no package" + ("" if v.headers else ", no headers to build"))
        v.lacks.append(f"no driverd package of {want['version']} ({want['flavor']}) is installed for it ({tree})"
                       + ("" if v.headers else f" and its headers are not installed to build one ({headers_pkg})"))
        fixes.append(f"{prepare}; when no repository has it, make the {want['version']} ({want['flavor']}) package "
                     f"for {rel} available in packages.repositories (driverd build --kernel {rel}, driverd repo index)"
                     + ("" if v.headers else f" or install {headers_pkg} with packages.source set"))
    elif (m.driver_version, m.flavor) != (want["version"], want["flavor"]):
        shorts.append("another driver")
        v.package = {"version": m.driver_version, "flavor": m.flavor, "sha256": tree_sha(d)}
        v.lacks.append(f"its driverd package is {m.driver_version} ({m.flavor}), the node runs {want['version']} "
                       f"({want['flavor']})")
        fixes.append(prepare)
    else:
        sha = tree_sha(d)
        v.package = {"version": m.driver_version, "flavor": m.flavor, "sha256": sha}
        if not is_installed(root, rel, sha, cfg["state.dir"]):
            shorts.append("incomplete package")
            v.lacks.append(f"its driverd package in {tree} is incomplete (a module file missing or of another size "
                           "than its manifest says, no install record, or an install still pending)")
            fixes.append(f"driverd prepare-kernel {rel} (an interrupted install is completed first)")
        elif bad := _vermagic_problems(root, d, m, rel):
            shorts.append("wrong vermagic")
            v.lacks += bad
            fixes.append(f"{prepare}, with a package built for {rel}")
        elif sig := _signature_problem(root, cfg, fam, d, rel):
            shorts.append("signature not trusted")
            v.lacks.append(sig[0])
            fixes.append(sig[1])
    v.short = ", ".join(shorts)
    v.fix = "; ".join(dict.fromkeys(f for f in fixes if f)) or None
    v.ready = not v.lacks
    return v


def _vermagic_problems(root, d, m, rel: str) -> list[str]:
    from driverd.errors import DriverdError
    from driverd.modinfo import vermagic_of
    from driverd.install.checks import kernel_vermagic
    out = []
    try:
        own = kernel_vermagic(root, rel)
    except DriverdError as e:
        return [e.message]
    for f in m.module_files:
        name = os.path.basename(f.path)
        try:
            vm = vermagic_of(d / name)
        except DriverdError as e:
            out.append(e.message)
            continue
        if not vm or vm.split()[0] != rel:
            out.append(f"module {name} has vermagic {vm!r}, not {rel}'s")
        elif own is not None and vm.split() != own.split():
            out.append(f"module {name} has vermagic {vm.strip()!r}, kernel {rel}'s own modules {own.strip()!r} (same "
                       "release name, another kernel configuration)")
    return out


def enforcement(root, fam, release: str) -> list[str]:
    """Why kernel `release` will enforce module signatures when it boots: its own configuration, and what
    the boot keeps (the command line, Secure Boot with a kernel that locks down under it, the lockdown the
    running kernel has — lockdown=... on the command line, or Secure Boot)."""
    from driverd.host.kernel import cmdline_params, kernel_config, parse_lockdown, read_cmdline, read_secure_boot
    from driverd.host.textfmt import kstrtobool
    config, source = kernel_config(root, release, ("CONFIG_MODULE_SIG_FORCE", "CONFIG_LOCK_DOWN_IN_EFI_SECURE_BOOT"))
    out = []
    if config.get("CONFIG_MODULE_SIG_FORCE") == "y":
        out.append(f"CONFIG_MODULE_SIG_FORCE=y ({source})")
    params = cmdline_params(read_cmdline(root))
    if "module.sig_enforce" in params and kstrtobool(params["module.sig_enforce"] or "1"):
        out.append("kernel command line module.sig_enforce=1")
    if read_secure_boot(root) == "enabled" and config.get("CONFIG_LOCK_DOWN_IN_EFI_SECURE_BOOT") == "y":
        out.append(f"Secure Boot is enabled and {release} locks down under it (CONFIG_LOCK_DOWN_IN_EFI_SECURE_BOOT=y)")
    lockdown = parse_lockdown(root.read_text("/sys/kernel/security/lockdown"))
    if lockdown in ("integrity", "confidentiality") and not out:
        out.append(f"the running kernel is locked down ({lockdown}); the next boot is assumed to be too")
    return out


def _signature_problem(root, cfg, fam, d, rel: str) -> tuple[str, str] | None:
    sources = enforcement(root, fam, rel)
    if not sources:
        return None
    from driverd.host.keyrings import read_keyrings
    from driverd.build import signers
    v = signers.check(root, read_keyrings(root), signers.tree_signatures(d), cfg, enforced=True,
                      source=f"installed {d}")
    if not v.blocks:
        return None
    return (f"it enforces module signatures ({'; '.join(sources)}) and would refuse the package: {v.summary}",
            v.enrol or f"sign the package with a key the kernel trusts (driverd build --sign-key/--sign-cert, a key "
                       f"enrolled with mokutil) and driverd prepare-kernel {rel}")
