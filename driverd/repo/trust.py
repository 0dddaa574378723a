"""Authentic and fresh repository indexes: who may serve an index, and how old it may be.

Authenticity: an index is accepted when its detached signature (index.json.sig, `openssl dgst
-sha256 -sign`) verifies against packages.index_public_key. Unsigned, it is accepted only from a
file:// repository (a directory this node already trusts as much as its own disk) or, for
http(s)://, with packages.insecure = true — and then a warning is printed at every use.

Freshness (against replay): a signed index carries `serial` (an integer that only grows; `driverd
repo index` writes max(previous + 1, unix time)) and `expires` (RFC 3339). The node keeps the
highest serial it has accepted *per signing key* — the SHA-256 fingerprint of the public key's
SubjectPublicKeyInfo (DER), what `openssl pkey -pubin -outform DER | sha256sum` prints — in
<state.dir>/repos/key-<fingerprint>.json, and refuses
- an index whose serial is lower than that (a rollback: an old index replayed to force a downgrade),
- an index past its expiry (a freeze: a mirror that keeps serving yesterday's index forever).
An equal serial is accepted (the same index read again). Every refusal is one line; a refused index
writes nothing (no state, no cache).

Keyed by the key, not by the URL (issue 30): an old index signed by the same key is refused whatever
URL serves it — another mirror, a repository moved to a new address, a second entry of
packages.repositories. Every repository one key signs therefore shares one serial sequence: publish
them together (or re-sign the older one) rather than keep an old index alive elsewhere. State files
of earlier driverd versions (<state.dir>/repos/<sha256(url)[:16]>.json, one per URL) are taken over:
until the key's own file exists, the highest serial any of them recorded is the one seen (they were
all accepted under the node's one packages.index_public_key), and they are removed once it is written.

This is the part of The Update Framework (TUF) that driverd needs: one signed metadata file that
pins every package by sha256 (so the snapshot/targets split and mix-and-match protection are moot),
a version counter and an expiry. Key rotation and threshold signatures are not covered: rotating
the index key means distributing the new public key by configuration (docs/signing.md).
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import sys
from datetime import datetime, timezone

from driverd.errors import PackageError

STATE_SUBDIR = "repos"
DEFAULT_VALID_DAYS = 30


class IndexRefused(PackageError):
    """The index is not authentic or not fresh: never skipped for the next repository."""


def parse_time(v: str | None) -> datetime | None:
    if not v:
        return None
    try:
        t = datetime.fromisoformat(v.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


_LEGACY_NAME = re.compile(r"[0-9a-f]{16}\.json")
_PEM_SPKI = re.compile(rb"-----BEGIN PUBLIC KEY-----([A-Za-z0-9+/=\s]+?)-----END PUBLIC KEY-----")


def key_fingerprint(public_key: str, runner=None) -> str:
    """`sha256:<hex>` of the public key's SubjectPublicKeyInfo (DER): the same for the same key in
    any encoding. A PEM `PUBLIC KEY` block is decoded here; any other form openssl reads is converted
    by `openssl pkey -pubin -pubout` first. IndexRefused when the key cannot be read."""
    def refuse(why: str) -> IndexRefused:
        return IndexRefused(f"packages.index_public_key {public_key} cannot be read as a public key: {why}",
                            fix="point packages.index_public_key at the repository's PEM public key")
    try:
        with open(public_key, "rb") as f:
            data = f.read(1 << 20)
    except OSError as e:
        raise refuse(e.strerror or str(e)) from None
    m = _PEM_SPKI.search(data)
    if m is None:
        from driverd.runner import Runner
        res = (runner or Runner()).run(["openssl", "pkey", "-pubin", "-in", public_key, "-pubout"], timeout=30,
                                       check=False, mutates=False)
        m = _PEM_SPKI.search(res.stdout.encode() if isinstance(res.stdout, str) else res.stdout or b"")
        if not res.ok or m is None:
            raise refuse("openssl pkey does not read it")
    try:
        der = base64.b64decode(b"".join(m.group(1).split()), validate=True)
    except ValueError:
        raise refuse("its PEM block is not base64") from None
    return "sha256:" + hashlib.sha256(der).hexdigest()


def _state_dir(state_dir: str) -> str:
    return f"{state_dir.rstrip('/')}/{STATE_SUBDIR}"


def state_hostpath(state_dir: str, fingerprint: str) -> str:
    """The host path of the freshness state of the key `fingerprint` (`sha256:<hex>`)."""
    algo, _, hexd = fingerprint.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hexd):
        raise ValueError(f"not a key fingerprint: {fingerprint!r}")
    return f"{_state_dir(state_dir)}/key-{hexd}.json"


def _serial_of(root, hostpath: str) -> int | None:
    try:
        d = json.loads(root.read_text(hostpath, 64 << 10) or "")
        v = d["serial"]
        return v if isinstance(v, int) and not isinstance(v, bool) else None
    except (ValueError, KeyError, TypeError):
        return None


def _legacy(root, state_dir: str) -> list[str]:
    """Host paths of the per-URL state files of earlier driverd versions."""
    d = _state_dir(state_dir)
    return [f"{d}/{n}" for n in root.listdir(d) if _LEGACY_NAME.fullmatch(n)]


def seen_serial(root, state_dir: str | None, fingerprint: str) -> int | None:
    """The highest serial this node has accepted from indexes signed by the key `fingerprint`; until
    that key's state exists, the highest one the per-URL files of earlier versions recorded."""
    if root is None or state_dir is None:
        return None
    own = _serial_of(root, state_hostpath(state_dir, fingerprint))
    if own is not None:
        return own
    old = [v for v in (_serial_of(root, p) for p in _legacy(root, state_dir)) if v is not None]
    return max(old) if old else None


def check(idx, url: str, where: str, *, signed: bool, seen: int | None, now: datetime | None = None,
          key: str | None = None, state_dir: str | None = None) -> None:
    """Raise IndexRefused when `idx` is expired, older than `seen` (the highest serial accepted from
    indexes signed by the key `key`), or signed without freshness."""
    now = now or datetime.now(timezone.utc)
    serial, expires = getattr(idx, "serial", None), getattr(idx, "expires", None)
    fix = "re-sign the repository: driverd repo index DIR --sign-key KEY (a new serial and expiry)"
    if signed and (serial is None or expires is None):
        raise IndexRefused(f"repository index {where} is signed but carries no serial or expiry",
                           cause="without them an old index could be replayed forever", fix=fix)
    if expires is not None:
        t = parse_time(expires)
        if t is None:
            raise IndexRefused(f"repository index {where} has an unreadable expiry {expires!r}", fix=fix)
        if t <= now:
            raise IndexRefused(f"repository index {where} (serial {serial}) expired at {expires}",
                               cause="an index past its expiry may be a stale mirror or a replay (freeze attack)",
                               fix=fix)
    if seen is not None and serial is not None and serial < seen:
        by = f" from indexes signed by key {key}" if key else ""
        state = (state_hostpath(state_dir, key) if key and state_dir else f"{STATE_SUBDIR}/ state")
        raise IndexRefused(f"repository index {where} has serial {serial}, older than serial {seen} this node "
                           f"has already seen{by}", cause="an older index replayed (rollback attack), from this URL "
                           "or another one serving indexes of the same key, or a repository rebuilt from an old "
                           "copy", fix=f"{fix}; or remove {state} only if the repository was deliberately reset")
    if seen is not None and serial is None and signed:
        raise IndexRefused(f"repository index {where} has no serial; this node has seen serial {seen}", fix=fix)


def record(root, state_dir: str | None, fingerprint: str, url: str, idx) -> None:
    """Remember the highest serial accepted from indexes signed by the key `fingerprint` (atomic,
    through the Root's confined writer; only ever raised). Per-URL files of earlier versions are
    removed once the key's own file is written."""
    serial = getattr(idx, "serial", None)
    if root is None or state_dir is None or serial is None:
        return
    seen = seen_serial(root, state_dir, fingerprint)
    own = root.lexists(state_hostpath(state_dir, fingerprint))
    if seen is not None and seen >= serial and own:
        return
    from driverd.redact import redact
    root.atomic_write_json(state_hostpath(state_dir, fingerprint), {
        "key": fingerprint, "serial": max(serial, seen or serial), "expires": getattr(idx, "expires", None),
        "url": redact(url), "accepted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}, 0o644)
    for p in _legacy(root, state_dir):
        root.unlink(p)


def unsigned_allowed(url: str, is_file_repo: bool, insecure: bool, where: str) -> None:
    """Refuse an unsigned index unless it comes from file:// or packages.insecure says so (logged)."""
    if is_file_repo:
        return
    if insecure:
        from driverd.redact import redact
        print(f"driverd: warning: accepting the UNSIGNED repository index {redact(where)} (packages.insecure = "
              "true): its packages are not authenticated", file=sys.stderr, flush=True)
        return
    raise IndexRefused(f"repository index {where} is not authenticated",
                       cause="packages.index_public_key is not set and the repository is not file://",
                       fix="set packages.index_public_key to the repository's public key (sign it with driverd repo "
                           "index DIR --sign-key KEY), or packages.insecure = true to accept it unsigned")

