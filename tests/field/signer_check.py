"""Read-only field check of the signer preflight on a live GPU host (standard library + asn1crypto,
which is pure Python and can be carried): the kernel's keyrings as driverd reads them (/proc/keys,
keyctl KEYCTL_READ, and the `keyctl` tool when installed), the loaded nvidia module's signature parsed
from its own file, and the verdict driverd would give. Loads, unloads and writes nothing.

    PYTHONPATH=.:<dir holding asn1crypto> python3 tests/field/signer_check.py [MODULE.ko ...]

Module files named on the command line are checked too (a driver loaded by a container from its own
file system has no file under the host's /lib/modules).
"""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys


def sh(argv: list[str]) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return (r.stdout + r.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"({e.__class__.__name__}: {e})"


def module_file(release: str, name: str) -> str | None:
    """The file of a module as modprobe resolves it: modules.dep under /lib/modules/<release>."""
    base = f"/lib/modules/{release}"
    try:
        with open(f"{base}/modules.dep") as f:
            for line in f:
                path = line.split(":", 1)[0]
                stem = os.path.basename(path).split(".ko")[0].replace("-", "_")
                if stem == name:
                    return path if path.startswith("/") else f"{base}/{path}"
    except OSError:
        pass
    for dp, _dn, fns in os.walk(base):
        for fn in fns:
            if fn.split(".ko")[0] == name and ".ko" in fn:
                return os.path.join(dp, fn)
    return None


def read_sig(path: str):
    from driverd.package.modsig import read_signature, signature_of_bytes
    if path.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            data = subprocess.run(["zstd", "-dc", path], capture_output=True, timeout=60).stdout
            return signature_of_bytes(path, data)
    return read_signature(path)


def main(extra: list[str]) -> int:
    from driverd.host.kernel import read_kernel
    from driverd.host.keyrings import read_keyrings
    from driverd.build.signers import judge
    from driverd.root import Root
    root = Root("/")
    k = read_kernel(root, [])
    print(f"== host: kernel {k.release} ({platform.machine()}), python {sys.version.split()[0]}, euid {os.geteuid()}")
    print(f"   signatures enforced: {k.module_signature_enforced} ({'; '.join(k.signature_enforcement_sources)})")
    print(f"   lockdown: {k.lockdown}   secure boot: {k.secure_boot}")
    print("== /proc/keys (system keyrings and asymmetric keys, verbatim)")
    try:
        for ln in open("/proc/keys").read().splitlines():
            if " asymmetri " in ln or any(r in ln for r in (".builtin_trusted_keys", ".secondary_trusted_keys",
                                                              ".platform", ".machine", ".blacklist")):
                print("   " + ln)
    except OSError as e:
        print(f"   unreadable: {e}")
    kr = read_keyrings(root)
    print(f"== driverd.host.keyrings: readable={kr.readable} membership={kr.membership} "
          f"keyrings={kr.keyrings}")
    for key in kr.keys:
        print(f"   {key.type} '{key.name}' id {key.key_id} in {', '.join(key.keyrings) or '?'}")
    for n in kr.notes:
        print(f"   note: {n}")
    if shutil.which("keyctl"):
        for ring in (".builtin_trusted_keys", ".secondary_trusted_keys", ".machine", ".platform"):
            print(f"== keyctl show %:{ring}")
            print("   " + sh(["keyctl", "show", f"%:{ring}"]).replace("\n", "\n   "))
    else:
        print("== keyctl: not installed (driverd uses the keyctl(2) system call itself)")
    print("== loaded nvidia")
    taint = (open("/sys/module/nvidia/taint").read().strip() if os.path.exists("/sys/module/nvidia/taint")
             else None)
    ver = open("/sys/module/nvidia/version").read().strip() if os.path.exists("/sys/module/nvidia/version") else None
    print(f"   /sys/module/nvidia: version {ver}, taint {taint!r} "
          + ("(no 'E': the kernel verified its signature at load)" if taint is not None and "E" not in taint
             else "('E': loaded without a verified signature)" if taint else ""))
    rel = k.release or os.uname().release
    for name, path in [(n, module_file(rel, n)) for n in ("nvidia", "nvidia_uvm")] + [(p, p) for p in extra]:
        print(f"   {name}: file {path}")
        if not path:
            continue
        sig = read_sig(path)
        print(f"     signed={sig.signed} id_type={sig.id_type} error={sig.error}")
        for s in sig.signers:
            print(f"     signer '{s.signer}' serial {s.serial} skid {s.skid} hash {s.hash_algo} algo {s.sig_algo}")
        if shutil.which("modinfo"):
            mi = sh(["modinfo", "-F", "signer", path]), sh(["modinfo", "-F", "sig_key", path])
            print(f"     modinfo: signer {mi[0]!r} sig_key {mi[1]!r}")
        v = judge([sig], kr, [], enforced=k.module_signature_enforced, source=path)
        print(f"     verdict: {v.status}: {v.summary}")
        if v.enrol:
            print(f"     enrol: {v.enrol}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
