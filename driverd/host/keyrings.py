"""The kernel's trusted keyrings, as far as userspace can see them.

Sources, in the kernel's own formats:

- `/proc/keys` (security/keys/proc.c proc_keys_show): one line per key the *reader may view*:
      "%08x %c%c%c%c%c%c%c %5d %4s %08x %5d %5d %-9.9s " + the type's describe()
  i.e. serial, flags (I R D Q U N i), usage, timeout ("perm"), permissions, uid, gid, type (cut to 9
  characters: "asymmetri", "keyring"), description. A keyring describes itself as "NAME: N" (N
  keys) or "NAME: empty"; an asymmetric key (crypto/asymmetric_keys/asymmetric_type.c) as
      "<description>: <id_type>.<algo> <last 4 bytes of its SKID> [<capabilities>]"
  and an X.509 key's description is "<subject>: <SKID hex>" (the serial in hex when the
  certificate has no SKID; x509_public_key.c). Example (Debian, as root):
      1f2c0a45 I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot CA: 6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1: X509.rsa bb419ea1 []
- Which keyring holds which key is *not* in /proc/keys. On the live host it is read with the
  keyctl(2) system call (KEYCTL_READ of a keyring returns its members' serials; what `keyctl show
  %:.builtin_trusted_keys` prints), without depending on the keyutils package. A captured or
  simulated tree carries the same answer in CAPTURE_PATH.

What userspace cannot see: the system keyrings' keys have permissions 0x1f010000 (possessor: all;
owner uid 0: view) — an unprivileged reader, or root in a user namespace, sees none of them; and
/proc/keys shows a key's subject and SKID but not its issuer or serial, which are what the kernel
matches a sign-file signature against (see driverd.package.modsig).
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.root import Root

# The keyrings that matter for modules (certs/system_keyring.c, security/integrity/).
BUILTIN = ".builtin_trusted_keys"
SECONDARY = ".secondary_trusted_keys"
MACHINE = ".machine"          # MOK keys (Linux >= 5.18, CONFIG_INTEGRITY_MACHINE_KEYRING), linked into secondary
PLATFORM = ".platform"        # UEFI db (and MOK on older kernels)
BLACKLIST = ".blacklist"
SYSTEM_KEYRINGS = (BUILTIN, SECONDARY, MACHINE, PLATFORM, BLACKLIST)
CAPTURE_PATH = "/var/lib/driverd/capture/keyrings.json"

_LINE = re.compile(r"^([0-9a-f]{8}) (\S+) +(\d+) +(\S+) ([0-9a-f]{8}) +(-?\d+) +(-?\d+) (\S+) *(.*)$")
_ASYM = re.compile(r"^(?P<desc>.*?): (?P<kind>[A-Za-z0-9]+\.[A-Za-z0-9_-]+)(?: (?P<tail>[0-9a-f]+))? \[[^\]]*\]$")
_KEYRING = re.compile(r"^(?P<name>.*?)(?:: (?:empty|\d+))?$")


@dataclass(frozen=True)
class KernelKey:
    """One key in the kernel's keyrings, as /proc/keys lists it."""
    serial: str                             # /proc/keys id (hex)
    type: str                               # asymmetric | keyring | blacklist | ...
    description: str                        # the key's description ("<subject>: <key id>" for X.509)
    name: str | None                        # the subject part of an X.509 key's description
    key_id: str | None                      # SKID (or serial) hex from the description
    algo: str | None = None                 # X509.rsa, X509.ecdsa, ...
    uid: int = 0
    perm: str = ""
    keyrings: tuple[str, ...] = ()          # system keyrings holding it (empty: not known)


@dataclass(frozen=True)
class KeyringFacts:
    """The kernel's trusted keyrings and the asymmetric keys this reader can see in them."""
    readable: bool                          # /proc/keys could be read
    membership: str                         # keyctl | capture | unknown
    keyrings: dict[str, str] = field(default_factory=dict)   # name -> /proc/keys serial, for those visible
    keys: tuple[KernelKey, ...] = ()        # asymmetric keys visible to this reader
    notes: tuple[str, ...] = ()

    def asymmetric(self) -> tuple[KernelKey, ...]:
        return tuple(k for k in self.keys if k.type.startswith("asymmetri"))

    def to_json(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


def parse_proc_keys(text: str) -> list[dict]:
    """/proc/keys lines as dicts (serial, flags, usage, timeout, perm, uid, gid, type, description)."""
    out = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        serial, flags, usage, timeout, perm, uid, gid, typ, desc = m.groups()
        out.append({"serial": serial, "flags": flags, "usage": int(usage), "timeout": timeout, "perm": perm,
                    "uid": int(uid), "gid": int(gid), "type": typ, "description": desc})
    return out


def parse_asymmetric(desc: str) -> tuple[str, str | None, str | None, str | None]:
    """An asymmetric key's /proc/keys description -> (key description, subject, key id hex, kind)."""
    m = _ASYM.match(desc)
    if not m:
        return desc, None, None, None
    d = m.group("desc")
    name, sep, kid = d.rpartition(": ")
    if sep and re.fullmatch(r"[0-9a-f]+", kid):
        return d, name, kid, m.group("kind")
    return d, d, None, m.group("kind")


def keyctl_members(serial: int) -> list[int] | None:
    """KEYCTL_READ (11) of a keyring on the live kernel: its members' serials (what `keyctl rlist`
    prints); None when not permitted or not available here."""
    import ctypes
    import os
    import sys
    nr = {"x86_64": 250, "aarch64": 219, "ppc64le": 311, "s390x": 280}.get(os.uname().machine)
    if nr is None:
        return None
    libc = _libc()
    if libc is None:
        return None
    size = 4096
    for _ in range(4):
        buf = ctypes.create_string_buffer(size)
        n = libc.syscall(ctypes.c_long(nr), ctypes.c_long(11), ctypes.c_long(serial), buf, ctypes.c_long(size))
        if n < 0:
            return None
        if n <= size:
            raw = buf.raw[:n]
            return [int.from_bytes(raw[i:i + 4], sys.byteorder, signed=True) for i in range(0, n - n % 4, 4)]
        size = n
    return None


@functools.cache
def _libc():
    """The C library this process already runs on (dlopen(NULL): its global symbols), for syscall(2).
    Not ctypes.util.find_library("c"): that runs `ldconfig -p` each time (issue 47: ~5 ms of detect)."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        return None
    return libc


def _membership_live(keyrings: dict[str, str]) -> dict[str, set[str]] | None:
    """serial hex -> system keyrings holding it, following keyrings linked into keyrings."""
    out: dict[str, set[str]] = {}
    any_read = False
    for name in SYSTEM_KEYRINGS:
        if name not in keyrings:
            continue
        seen: set[int] = set()
        todo = [int(keyrings[name], 16)]
        while todo:
            ring = todo.pop()
            if ring in seen:
                continue
            seen.add(ring)
            members = keyctl_members(ring)
            if members is None:
                continue
            any_read = True
            for s in members:
                h = f"{s & 0xffffffff:08x}"
                out.setdefault(h, set()).add(name)
                if h in keyrings.values():       # a keyring linked in (secondary links builtin and .machine)
                    todo.append(s & 0xffffffff)
    return out if any_read else None


def _membership_capture(root: Root) -> dict[str, set[str]] | None:
    text = root.read_text(CAPTURE_PATH)
    if not text:
        return None
    try:
        doc = json.loads(text)
        return {str(k): set(v) for k, v in (doc.get("members") or {}).items()}
    except (ValueError, TypeError, AttributeError):
        return None


def read_keyrings(root: Root, warnings: list[str] | None = None) -> KeyringFacts:
    text = root.read_text("/proc/keys")
    if text is None:
        return KeyringFacts(False, "unknown", notes=("/proc/keys is not readable (no CONFIG_KEYS, or /proc not "
                                                      "mounted): the kernel's keys cannot be listed",))
    rows = parse_proc_keys(text)
    keyrings: dict[str, str] = {}
    for r in rows:
        if r["type"] == "keyring":
            name = _KEYRING.match(r["description"]).group("name")
            if name in SYSTEM_KEYRINGS:
                keyrings.setdefault(name, r["serial"])
    members, how = None, "unknown"
    if root.is_live():
        members = _membership_live(keyrings)
        how = "keyctl" if members is not None else how
    if members is None:
        members = _membership_capture(root)
        how = "capture" if members is not None else how
    keys = []
    for r in rows:
        if r["type"] == "keyring":
            continue
        desc, name, kid, kind = parse_asymmetric(r["description"]) if r["type"].startswith("asymmetri") else (
            r["description"], None, None, None)
        keys.append(KernelKey(r["serial"], "asymmetric" if r["type"].startswith("asymmetri") else r["type"], desc,
                              name, kid, kind, r["uid"], r["perm"],
                              tuple(sorted((members or {}).get(r["serial"], ())))))
    notes = []
    if not keyrings:
        notes.append("/proc/keys shows none of the system keyrings: they are visible to uid 0 of the initial user "
                     "namespace only (run as root on the host), or the kernel has none")
    elif how == "unknown":
        notes.append("which keyring holds each key is unknown (keyctl KEYCTL_READ not permitted here); keys are "
                     "matched without their keyring")
    for name in (BUILTIN, SECONDARY):
        if keyrings and name not in keyrings:
            notes.append(f"{name} is not visible in /proc/keys (a kernel without it, or not viewable here)")
    return KeyringFacts(True, how, keyrings, tuple(k for k in keys if k.type in ("asymmetric", "blacklist")),
                        tuple(notes))


def render_capture(facts: KeyringFacts) -> dict:
    """The membership record a capture carries (CAPTURE_PATH) so a tree answers like the live host."""
    return {"members": {k.serial: list(k.keyrings) for k in facts.keys if k.keyrings}}
