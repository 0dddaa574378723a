"""Kernel facts: release, version, signature enforcement, lockdown, Secure Boot, unload support, headers."""
from __future__ import annotations

import gzip
import re

from driverd.host.facts import KernelFacts
from driverd.root import Root

EFI_GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-e0a9e8d14b8c"
_ARCH_FROM_RELEASE = {"amd64": "x86_64", "arm64": "aarch64", "x86_64": "x86_64", "aarch64": "aarch64",
                      "ppc64le": "ppc64le", "s390x": "s390x"}


def read_cmdline(root: Root) -> str:
    return (root.read_text("/proc/cmdline") or "").strip()


def cmdline_params(cmdline: str) -> dict[str, str]:
    """Kernel command-line parameters; the last occurrence wins, as in the kernel."""
    out: dict[str, str] = {}
    for tok in cmdline.split():
        k, _, v = tok.partition("=")
        out[k] = v if _ else ""
    return out


def kernel_config(root: Root, release: str | None) -> tuple[dict[str, str], str | None]:
    """CONFIG_* options from /boot/config-<release>, else /proc/config.gz (when IKCONFIG_PROC)."""
    text = None
    source = None
    if release:
        text = root.read_text(f"/boot/config-{release}")
        source = f"/boot/config-{release}" if text is not None else None
    if text is None:
        raw = root.read_bytes("/proc/config.gz", 16 << 20)
        if raw:
            try:
                text = gzip.decompress(raw).decode("utf-8", errors="replace")
                source = "/proc/config.gz"
            except (OSError, EOFError):
                text = None
    opts: dict[str, str] = {}
    for line in (text or "").splitlines():
        if line.startswith("CONFIG_") and "=" in line:
            k, _, v = line.partition("=")
            opts[k] = v.strip().strip('"')
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            opts[line[2:-len(" is not set")]] = "n"
    return opts, source


def parse_lockdown(text: str | None) -> str | None:
    """/sys/kernel/security/lockdown reads e.g. 'none [integrity] confidentiality'."""
    if text is None:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


def read_secure_boot(root: Root) -> str:
    if not root.is_dir("/sys/firmware/efi"):
        return "not-efi"
    data = root.read_bytes(f"/sys/firmware/efi/efivars/SecureBoot-{EFI_GLOBAL_GUID}")
    if data is None or len(data) < 5:
        # efivarfs not mounted, or the legacy sysfs efi/vars interface
        data2 = root.read_bytes(f"/sys/firmware/efi/vars/SecureBoot-{EFI_GLOBAL_GUID}/data")
        if not data2:
            return "unknown"
        value = data2[0]
    else:
        value = data[4]  # efivarfs: 4 bytes of attributes, then the variable's value
    setup = root.read_bytes(f"/sys/firmware/efi/efivars/SetupMode-{EFI_GLOBAL_GUID}")
    if value == 1:
        return "enabled"
    if setup is not None and len(setup) >= 5 and setup[4] == 1:
        return "setup-mode"
    return "disabled"


def module_unload_evidence(proc_modules: str | None, config: dict[str, str]) -> tuple[bool, str]:
    """Whether `rmmod` can work. In /proc/modules the refcount column reads '-' (and the holders
    column '-') for every module when the kernel was built without CONFIG_MODULE_UNLOAD."""
    rows = [ln.split() for ln in (proc_modules or "").splitlines() if ln.strip()]
    rows = [r for r in rows if len(r) >= 3]
    if rows:
        if all(r[2] == "-" for r in rows):
            return False, "/proc/modules shows no reference counts (kernel built without CONFIG_MODULE_UNLOAD)"
        return True, "/proc/modules shows reference counts"
    val = config.get("CONFIG_MODULE_UNLOAD")
    if val is not None:
        return val == "y", f"kernel config CONFIG_MODULE_UNLOAD={val}"
    if proc_modules is None and config.get("CONFIG_MODULES") == "n":
        return False, "kernel built without loadable module support"
    return True, "no evidence either way; assumed supported"


def read_kernel(root: Root, warnings: list[str]) -> KernelFacts:
    release = root.read_first_line("/proc/sys/kernel/osrelease") or None
    version = root.read_first_line("/proc/version") or None
    if release is None and version:
        m = re.match(r"Linux version (\S+)", version)
        release = m.group(1) if m else None
    if release is None:
        warnings.append("kernel release unknown: /proc/sys/kernel/osrelease and /proc/version are missing")
    arch = root.read_first_line("/proc/sys/kernel/arch") or None
    if arch is None and release:
        arch = _ARCH_FROM_RELEASE.get(release.rsplit("-", 1)[-1])
    cmdline = read_cmdline(root)
    params = cmdline_params(cmdline)
    config, config_source = kernel_config(root, release)
    proc_modules = root.read_text("/proc/modules")

    sources: list[str] = []
    sig = root.read_first_line("/sys/module/module/parameters/sig_enforce")
    if sig is not None and sig.upper() in ("Y", "1"):
        sources.append("/sys/module/module/parameters/sig_enforce=Y")
    if params.get("module.sig_enforce") in ("1", "y", "Y"):
        sources.append("kernel command line module.sig_enforce=1")
    if config.get("CONFIG_MODULE_SIG_FORCE") == "y":
        sources.append(f"CONFIG_MODULE_SIG_FORCE=y ({config_source})")
    lockdown = parse_lockdown(root.read_text("/sys/kernel/security/lockdown"))
    if lockdown in ("integrity", "confidentiality"):
        # Lockdown rejects unsigned modules regardless of sig_enforce (kernel/module/signing.c).
        sources.append(f"kernel lockdown={lockdown}")

    unload, evidence = module_unload_evidence(proc_modules, config)
    modules_supported = proc_modules is not None or config.get("CONFIG_MODULES") == "y"
    if proc_modules is None and root.is_dir("/proc/sys"):
        warnings.append("/proc/modules is missing: this kernel cannot load modules (or /proc is not mounted)")

    headers_path = None
    headers_present = False
    if release:
        build = f"/lib/modules/{release}/build"
        resolved = root.resolve(build)
        if root.is_dir(resolved) and (root.exists(f"{resolved}/Makefile")):
            headers_present, headers_path = True, resolved
    return KernelFacts(
        release=release, version=version, arch=arch, cmdline=cmdline, modules_supported=modules_supported,
        module_signature_enforced=bool(sources), signature_enforcement_sources=tuple(sources),
        lockdown=lockdown, secure_boot=read_secure_boot(root), module_unload_supported=unload,
        module_unload_evidence=evidence, headers_present=headers_present, headers_path=headers_path,
        config_source=config_source)
