"""No secret in any output (issue 21): credentials written into a repository URL
(`https://user:token@mirror/…`) are stripped wherever driverd says something — error messages,
logs, /readyz, /run/driverd/daemon.json, the journal, Node annotations, conditions and Events.
Standard library only, importable from every layer (driverd.errors uses it).

Credentials belong in `packages.netrc` or `packages.auth_header_file`, not in the URL; a URL that
carries them still works, it is only never repeated.

How (issue 30: a password with `'` in it survived a pattern that stopped at quotes): URLs are
*tokenized* in the text by RFC 3986's grammar, not guessed by a pattern. A URL starts at a scheme
(`ALPHA *( ALPHA / DIGIT / "+" / "-" / "." )`) followed by `://`; its authority runs to the first
`/`, `?` or `#` (RFC 3986 §3.2) or to the first character no URI may contain (§2: space and controls,
`"`, `<`, `>`, `\\`, `^`, `` ` ``, `{`, `|`, `}`; characters beyond ASCII are taken as RFC 3987 IRI
characters unless they are blanks or controls). Everything in the authority before its last `@` is
the userinfo (§3.2.1; urllib.parse splits a netloc the same way) and is removed — whatever legal
characters it holds, sub-delims such as `'`, `(`, `!`, `;`, `=` and percent-encodings included, and a
raw `@` too. The cost of erring is on the safe side: text glued to a URL without a separator may be
removed with the userinfo, never left beside it.
"""
from __future__ import annotations

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_SCHEME = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://")
_NEVER_IN_A_URI = frozenset(' "<>\\^`{|}')         # RFC 3986 §2: excluded from every URI
_END_OF_AUTHORITY = frozenset("/?#")               # RFC 3986 §3.2


def _in_uri(c: str) -> bool:
    """Whether `c` can be part of a URI (RFC 3986 §2) or an IRI (RFC 3987 ucschar)."""
    o = ord(c)
    if o < 0x80:
        return 0x20 < o < 0x7F and c not in _NEVER_IN_A_URI
    # imported here: its tables are ~1 ms of every command's start on a GPU host (issue 47), and only a
    # non-ASCII character beside a URL's '@' gets this far
    import unicodedata
    return not c.isspace() and unicodedata.category(c) not in ("Cc", "Cf", "Zs", "Zl", "Zp", "Cs")


def _authority_end(text: str, start: int) -> int:
    i, n = start, len(text)
    while i < n and text[i] not in _END_OF_AUTHORITY and _in_uri(text[i]):
        i += 1
    return i


def redact(text: str) -> str:
    """`text` with the userinfo of every URL in it removed."""
    if "@" not in text or "://" not in text:
        return text
    out: list[str] = []
    pos = 0
    for m in _SCHEME.finditer(text):
        if m.start() < pos:                 # inside the authority of the previous URL
            continue
        start = m.end()
        end = _authority_end(text, start)
        userinfo, at, _hostport = text[start:end].rpartition("@")
        out.append(text[pos:start])
        pos = start + len(userinfo) + len(at) if at else start
    out.append(text[pos:])
    return "".join(out)


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
