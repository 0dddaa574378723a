"""OS identity from os-release(5): /etc/os-release, falling back to /usr/lib/os-release."""
from __future__ import annotations

import re

from driverd.host.facts import OsFacts
from driverd.root import Root

_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def parse_os_release(text: str) -> tuple[dict[str, str], list[str]]:
    """os-release(5): newline-separated KEY=value lines, '#' comment lines and blank lines; values
    may be single- or double-quoted with shell escapes. Files written on Windows (CRLF) or with a
    UTF-8 byte-order mark are tolerated. Returns the variables and the malformed lines (reported,
    never fatal)."""
    out: dict[str, str] = {}
    bad: list[str] = []
    text = text.removeprefix("\ufeff")
    for n, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            bad.append(f"line {n}: {line[:60]!r}")
            continue
        key, value = m.groups()
        parsed = shell_value(value)
        if parsed is None:
            bad.append(f"line {n}: unbalanced quotes")
        else:
            out[key] = parsed
    return out, bad


def shell_value(value: str) -> str | None:
    """The value of a shell-style assignment's right-hand side (os-release(5): "following shell
    style"): '...' is literal; inside "..." a backslash escapes only $ ` " \\; outside quotes it
    escapes any character. Unquoted words separated by blanks are joined with one space (not valid
    shell, but seen in the wild). None when a quote is left open."""
    out: list[str] = []
    words: list[str] = []
    i, n = 0, len(value)
    while i < n:
        c = value[i]
        if c == "'":
            j = value.find("'", i + 1)
            if j < 0:
                return None
            out.append(value[i + 1:j])
            i = j + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    return None
                c = value[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and value[i + 1] in '$`"\\':
                    out.append(value[i + 1])
                    i += 2
                    continue
                out.append(c)
                i += 1
        elif c == "\\" and i + 1 < n:
            out.append(value[i + 1])
            i += 2
        elif c in " \t":
            if out:
                words.append("".join(out))
                out = []
            i += 1
        else:
            out.append(c)
            i += 1
    if out or not words:
        words.append("".join(out))
    return " ".join(words)


def read_os(root: Root, warnings: list[str]) -> OsFacts:
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        text = root.read_text(path)
        if text is None:
            continue
        vals, bad = parse_os_release(text)
        for b in bad:
            warnings.append(f"{path}: malformed {b}")
        if "ID" not in vals:
            warnings.append(f"{path}: no ID= line; OS reported as linux (the os-release default)")
        return OsFacts(id=vals.get("ID", "linux").lower() or "linux", version_id=vals.get("VERSION_ID") or None,
                       id_like=tuple(vals.get("ID_LIKE", "").lower().split()), pretty_name=vals.get("PRETTY_NAME"),
                       version_codename=vals.get("VERSION_CODENAME") or None, source=path)
    warnings.append("no os-release file (/etc/os-release, /usr/lib/os-release): OS unknown")
    return OsFacts(id="unknown", version_id=None)
