"""The real kmod tools from the test side: their `modinfo` output parsed, and a way to run a command on
a machine as it comes without kmod — in a private mount namespace (unshare -m) where an empty,
non-executable file is bind-mounted over the kmod binary every tool name links to, so neither PATH
nor driverd.runner.which (which also looks in /usr/sbin, /sbin, ...) finds modinfo, depmod, modprobe,
insmod, rmmod or lsmod. The machine itself is not changed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import missing_component, require_binary

KMOD_TOOLS = ("modinfo", "depmod", "modprobe", "insmod", "rmmod", "lsmod", "kmod")


_FIELD = re.compile(r"([A-Za-z0-9_]+)(=|:[ \t]*)(.*)", re.S)


def parse_modinfo(text: str) -> list[dict[str, list[str]]]:
    """`modinfo -0 a.ko b.ko` output: one dict per file, field -> values in order. -0 separates the
    fields with NULs, so a value with newlines (a parameter's multi-line description) stays one
    value; modinfo prints `filename` and `parm` as 'key:  value', the rest as key=value. Values are
    stripped of surrounding blanks (vermagic ends with one), the signature's hex dump, wrapped by
    modinfo, of all blanks."""
    out: list[dict[str, list[str]]] = []
    cur: dict[str, list[str]] | None = None
    for chunk in text.split("\0"):
        m = _FIELD.fullmatch(chunk.strip("\n"))
        if not m:
            continue
        key, value = m.group(1), m.group(3)
        if key == "filename" or cur is None:
            cur = {}
            out.append(cur)
        cur.setdefault(key, []).append("".join(value.split()) if key == "signature" else value.strip())
    return out


def kmod_sig_key(cert: Path) -> str:
    """How kmod's modinfo prints `sig_key` for a module signed with `cert` (PKCS#7, issuer + serial):
    the serial number's own bytes, upper-case hex joined by ':'. A random serial is not always 20
    bytes: DER's leading 00 (top bit set) is not printed, and a serial whose first byte is 0 has 19."""
    out = subprocess.run(["openssl", "x509", "-noout", "-serial", "-in", str(cert)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    n = int(out.strip().split("=", 1)[1], 16)
    return ":".join(f"{b:02X}" for b in n.to_bytes(max(1, (n.bit_length() + 7) // 8), "big"))


def kmod_modinfo(paths) -> dict[str, dict[str, list[str]]]:
    """realpath -> fields, from one run of kmod's modinfo."""
    exe = require_binary("modinfo", "/usr/sbin/modinfo", "/sbin/modinfo")
    res = subprocess.run([exe, "-0", *map(str, paths)], capture_output=True, text=True, check=True, timeout=120)
    return {os.path.realpath(p["filename"][0]): p for p in parse_modinfo(res.stdout)}


def _kmod_binaries() -> list[str]:
    from driverd.runner import which
    return sorted({os.path.realpath(p) for p in (which(t) for t in KMOD_TOOLS) if p})


def run_without_kmod(argv: list[str], tmp: Path, env: dict | None = None, timeout: float = 600
                     ) -> subprocess.CompletedProcess:
    """Run `argv` where kmod is absent (see the module docstring). Before the command, the same
    namespace proves the tools are gone for driverd's own lookup (driverd.runner.which)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True, timeout=30).returncode != 0:
        missing_component("hiding kmod needs root and unshare (util-linux) allowed to make a private mount namespace")
    empty = tmp / "no-kmod"
    empty.write_bytes(b"")
    empty.chmod(0o644)
    binds = " && ".join(f"mount --bind {empty} {b}" for b in _kmod_binaries()) or "true"
    probe = (f"{sys.executable} -c \"from driverd.runner import which; "
             f"found = [t for t in {KMOD_TOOLS!r} if which(t)]; assert not found, found\"")
    script = f"{binds} && {probe} && exec \"$@\""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")}
    full_env.update(env or {})
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, env=full_env, timeout=timeout)
