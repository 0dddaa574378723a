"""No secret in any output (issue 21): credentials written into a repository URL
(`https://user:token@mirror/…`) are stripped wherever driverd says something — error messages,
logs, /readyz, /run/driverd/daemon.json, the journal, Node annotations, conditions and Events.
Standard library only, importable from every layer (driverd.errors uses it).

Credentials belong in `packages.netrc` or `packages.auth_header_file`, not in the URL; a URL that
carries them still works, it is only never repeated."""
from __future__ import annotations

import re
from typing import Any

# scheme://userinfo@ — the userinfo runs to the last '@' before the authority ends ('/', '?', '#',
# whitespace or a quote), so a password containing a raw '@' is removed whole.
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s\"'<>]*@")


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it removed."""
    if "@" not in text:
        return text
    return _USERINFO.sub(r"\1", text)


def redact_url(url: str) -> str:
    return redact(url)


def redact_obj(obj: Any) -> Any:
    """A JSON-like value with every string (keys included) redacted; other values as they are."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact(k) if isinstance(k, str) else k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_obj(v) for v in obj)
    return obj
