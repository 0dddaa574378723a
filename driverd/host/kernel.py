"""Kernel facts: release, version, signature enforcement, lockdown, Secure Boot, unload support, headers."""
from __future__ import annotations

import re
import zlib

from driverd.host.facts import KernelFacts
from driverd.host.textfmt import kstrtobool
from driverd.root import Root

EFI_GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-e0a9e8d14b8c"
_ARCH_FROM_RELEASE = {"amd64": "x86_64", "arm64": "aarch64", "x86_64": "x86_64", "aarch64": "aarch64",
                      "ppc64le": "ppc64le", "s390x": "s390x"}


def read_cmdline(root: Root) -> str:
    return (root.read_text("/proc/cmdline") or "").strip()


def cmdline_args(cmdline: str) -> list[tuple[str, str | None]]:
    """(name, value) pairs in order, split the way the kernel's next_arg() (lib/cmdline.c) does:
    double quotes group spaces (`dyndbg="file x +p"`, `"a b=c"`), the quotes are dropped, a bare
    word has value None, and a lone `--` ends the kernel's parameters (the rest goes to init).
    Names compare with '-' and '_' equal (kernel/params.c parameq()), so names are normalised to '_'."""
    out: list[tuple[str, str | None]] = []
    s = cmdline
    i, n = 0, len(s)
    while i < n:
        while i < n and s[i].isspace():
            i += 1
        if i >= n:
            break
        quoted = s[i] == '"'
        if quoted:
            i += 1
        start, in_quote, equals = i, quoted, -1
        while i < n and (in_quote or not s[i].isspace()):
            if equals < 0 and s[i] == "=":
                equals = i
            if s[i] == '"':
                in_quote = not in_quote
            i += 1
        tok = s[start:i]
        if equals < 0:
            name, value = tok.rstrip('"') if quoted else tok, None
        else:
            name, value = s[start:equals], s[equals + 1:i]
            if value.startswith('"'):
                value = value[1:]
                if value.endswith('"'):
                    value = value[:-1]
            elif quoted and value.endswith('"'):
                value = value[:-1]
        if value is None and name == "--":
            break
        out.append((name.replace("-", "_"), value))
    return out


def cmdline_params(cmdline: str) -> dict[str, str]:
    """Kernel command-line parameters; the last occurrence wins, as in the kernel. A bare word
    maps to "" (for a bool parameter the kernel reads that as true)."""
    return {k: ("" if v is None else v) for k, v in cmdline_args(cmdline)}


def kernel_config(root: Root, release: str | None, keys: tuple[str, ...]) -> tuple[dict[str, str], str | None]:
    """The CONFIG_* options `keys` (those set or `is not set`) from /boot/config-<release>, else
    /proc/config.gz (when IKCONFIG_PROC). Each caller names the few it judges by: a distribution's
    config has ~10,000 lines, and parsing them all was a tenth of `detect` (issue 47)."""
    text = None
    source = None
    if release:
        text = root.read_text(f"/boot/config-{release}")
        source = f"/boot/config-{release}" if text is not None else None
    if text is None:
        raw = root.read_bytes("/proc/config.gz", 16 << 20)
        if raw:
            text = _gunzip(raw, 64 << 20)
            source = "/proc/config.gz" if text is not None else None
    return _pick(text or "", keys), source


def _pick(text: str, keys: tuple[str, ...]) -> dict[str, str]:
    """`keys` found by the C string search, line by line as Kconfig writes them: the later of `K=v` and
    `# K is not set` wins."""
    text = "\n" + text
    opts: dict[str, str] = {}
    for k in keys:
        set_at, unset_at = text.rfind(f"\n{k}="), text.rfind(f"\n# {k} is not set\n")
        if unset_at < 0 and text.endswith(f"\n# {k} is not set"):
            unset_at = len(text) - len(f"\n# {k} is not set")
        if set_at > unset_at:
            start = set_at + len(k) + 2
            end = text.find("\n", start)
            opts[k] = text[start:end if end >= 0 else len(text)].strip().strip('"')
        elif unset_at >= 0:
            opts[k] = "n"
    return opts


def _gunzip(raw: bytes, cap: int) -> str | None:
    """A gzip member, decompressed to at most `cap` bytes; None when it is not gzip at all."""
    try:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        data = d.decompress(raw, cap)
    except zlib.error:
        return None
    return data.decode("utf-8", errors="replace")


LOCKDOWN_LEVELS = ("none", "integrity", "confidentiality")


def parse_lockdown(text: str | None) -> str | None:
    """security/lockdown/lockdown.c lockdown_read() prints every level, the active one in
    brackets: 'none [integrity] confidentiality'. Anything else (empty, junk) is unknown."""
    if text is None:
        return None
    m = re.search(r"\[([a-z]+)\]", text)
    return m.group(1) if m and m.group(1) in LOCKDOWN_LEVELS else None


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


# utsname.release is at most 64 characters (__NEW_UTS_LEN); it names a directory under
# /lib/modules, so anything with a slash, whitespace or control characters is not a release.
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,63}")


def running_release(root: Root) -> str | None:
    """The running kernel's release (utsname.release), validated; the one place it is read."""
    return _release(root.read_first_line("/proc/sys/kernel/osrelease") or None)


def _release(text: str | None) -> str | None:
    return text if text and _RELEASE.fullmatch(text) else None


# the kernel config options read_kernel judges by
CONFIG_KEYS = ("CONFIG_MODULE_SIG_FORCE", "CONFIG_MODULE_UNLOAD", "CONFIG_MODULES")


def read_kernel(root: Root, warnings: list[str]) -> KernelFacts:
    raw_release = root.read_first_line("/proc/sys/kernel/osrelease") or None
    release = _release(raw_release)
    if raw_release and release is None:
        warnings.append(f"/proc/sys/kernel/osrelease is garbled ({raw_release[:40]!r}); ignored")
    version = root.read_first_line("/proc/version") or None
    if release is None and version:
        m = re.match(r"Linux version (\S+)", version)
        release = _release(m.group(1)) if m else None
    if release is None:
        warnings.append("kernel release unknown: /proc/sys/kernel/osrelease and /proc/version are missing")
    arch = root.read_first_line("/proc/sys/kernel/arch") or None
    if arch is None and release:
        arch = _ARCH_FROM_RELEASE.get(release.rsplit("-", 1)[-1])
    cmdline = read_cmdline(root)
    params = cmdline_params(cmdline)
    config, config_source = kernel_config(root, release, CONFIG_KEYS)
    proc_modules = root.read_text("/proc/modules")

    sources: list[str] = []
    # kernel/module/signing.c: sig_enforce is a bool_enable_only parameter, printed "Y"/"N", that
    # starts as IS_ENABLED(CONFIG_MODULE_SIG_FORCE) and can be switched on (only) by the command
    # line. CONFIG_MODULE_SIG without FORCE therefore means "checked, not enforced".
    sig = root.read_first_line("/sys/module/module/parameters/sig_enforce")
    if kstrtobool(sig):
        sources.append("/sys/module/module/parameters/sig_enforce=Y")
    if "module.sig_enforce" in params and kstrtobool(params["module.sig_enforce"] or "1"):
        # a bare `module.sig_enforce` sets a bool parameter (kernel/params.c param_set_bool)
        sources.append("kernel command line module.sig_enforce=1")
    if config.get("CONFIG_MODULE_SIG_FORCE") == "y":
        sources.append(f"CONFIG_MODULE_SIG_FORCE=y ({config_source})")
    lockdown_text = root.read_text("/sys/kernel/security/lockdown")
    lockdown = parse_lockdown(lockdown_text)
    if lockdown_text is not None and lockdown is None:
        warnings.append("/sys/kernel/security/lockdown is empty or garbled: lockdown level unknown")
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
        try:
            resolved = root.resolve(build)
        except OSError:
            resolved = build
            warnings.append(f"{build}: symlink loop; kernel headers treated as missing")
        if root.is_dir(resolved) and (root.exists(f"{resolved}/Makefile")):
            headers_present, headers_path = True, resolved
    return KernelFacts(
        release=release, version=version, arch=arch, cmdline=cmdline, modules_supported=modules_supported,
        module_signature_enforced=bool(sources), signature_enforcement_sources=tuple(sources),
        lockdown=lockdown, secure_boot=read_secure_boot(root), module_unload_supported=unload,
        module_unload_evidence=evidence, headers_present=headers_present, headers_path=headers_path,
        config_source=config_source)
