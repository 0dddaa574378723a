"""Authentic and fresh repository indexes: who may serve an index, and how old it may be.

Authenticity: an index is accepted when its detached signature (index.json.sig, `openssl dgst
-sha256 -sign`) verifies against packages.index_public_key. Unsigned, it is accepted only from a
file:// repository (a directory this node already trusts as much as its own disk) or, for
http(s)://, with packages.insecure = true — and then a warning is printed at every use.

Freshness (against replay): a signed index carries `serial` (an integer that only grows; `driverd
repo index` writes max(previous + 1, unix time)) and `expires` (RFC 3339). The node keeps the
highest serial it has accepted per repository in <state.dir>/repos/<id>.json and refuses
- an index whose serial is lower than that (a rollback: an old index replayed to force a downgrade),
- an index past its expiry (a freeze: a mirror that keeps serving yesterday's index forever).
An equal serial is accepted (the same index read again). Every refusal is one line; a refused index
writes nothing (no state, no cache).

This is the part of The Update Framework (TUF) that driverd needs: one signed metadata file that
pins every package by sha256 (so the snapshot/targets split and mix-and-match protection are moot),
a version counter and an expiry. Key rotation and threshold signatures are not covered: rotating
the index key means distributing the new public key by configuration (docs/signing.md).
"""
from __future__ import annotations

import hashlib
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

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


def state_path(root, state_dir: str, url: str) -> Path:
    rid = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return root.real(f"{state_dir}/{STATE_SUBDIR}") / f"{rid}.json"


def seen_serial(root, state_dir: str | None, url: str) -> int | None:
    if root is None or state_dir is None:
        return None
    try:
        d = json.loads(state_path(root, state_dir, url).read_text())
        return int(d["serial"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check(idx, url: str, where: str, *, signed: bool, seen: int | None, now: datetime | None = None) -> None:
    """Raise IndexRefused when `idx` is expired, older than `seen`, or signed without freshness."""
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
        raise IndexRefused(f"repository index {where} has serial {serial}, older than serial {seen} this node "
                           "has already seen", cause="an older index replayed (rollback attack) or a repository "
                           "rebuilt from an old copy", fix=f"{fix}; or remove {STATE_SUBDIR}/ state only if the "
                           "repository was deliberately reset")
    if seen is not None and serial is None and signed:
        raise IndexRefused(f"repository index {where} has no serial; this node has seen serial {seen}", fix=fix)


def record(root, state_dir: str | None, url: str, idx) -> None:
    """Remember the highest serial accepted from `url` (atomic; only ever raised)."""
    serial = getattr(idx, "serial", None)
    if root is None or state_dir is None or serial is None:
        return
    seen = seen_serial(root, state_dir, url)
    if seen is not None and seen >= serial:
        return
    from driverd.fsutil import atomic_write_json
    p = state_path(root, state_dir, url)
    p.parent.mkdir(parents=True, exist_ok=True)
    from driverd.redact import redact
    atomic_write_json(p, {"url": redact(url), "serial": serial, "expires": getattr(idx, "expires", None),
                          "accepted_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})


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

