"""Reading driverd's JSON records of a driver: absent is None, damaged is {} (never an exception)."""
from __future__ import annotations

import json
import re

from driverd.root import Root

_SHA = re.compile(r"[0-9a-f]{64}")


def valid_sha(v: object) -> bool:
    return isinstance(v, str) and _SHA.fullmatch(v) is not None


def read_json(root: Root, hostpath: str) -> dict | None:
    """None: absent; {}: unreadable or not an object."""
    if root.lstat(hostpath) is None:
        return None
    try:
        d = json.loads(root.read_bytes(hostpath, 1 << 20) or b"")
    except (ValueError, RecursionError):
        return {}
    return d if isinstance(d, dict) else {}
