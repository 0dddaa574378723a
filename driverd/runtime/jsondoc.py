"""JSON editing that keeps every key and its order (Docker's daemon.json) and reports syntax errors
with line and column, the way dockerd itself would refuse the file."""
from __future__ import annotations

import json
import re

from driverd.errors import EXIT_USAGE, RuntimeConfigError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from driverd.runtime.changes import Change


def parse(text: str, path: str) -> dict:
    if not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeConfigError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno})", cause=e.msg,
                                 fix=f"fix the syntax at {path}:{e.lineno}:{e.colno}; driverd wrote nothing",
                                 exit_code=EXIT_USAGE) from None
    if not isinstance(doc, dict):
        raise RuntimeConfigError(f"{path} is not a JSON object", fix="daemon.json must be an object {...}",
                                 exit_code=EXIT_USAGE)
    return doc


def indent_of(text: str) -> int | str:
    m = re.search(r"\n([ \t]+)\S", text)
    if not m:
        return 4
    ws = m.group(1)
    return "\t" if ws.startswith("\t") else len(ws)


def dumps(doc: dict, like: str) -> str:
    return json.dumps(doc, indent=indent_of(like), ensure_ascii=False) + "\n"


def set_key(doc: dict, key: list[str], value: Any) -> Change:
    from driverd.runtime.changes import Change
    cur = doc
    for i, k in enumerate(key[:-1]):
        if k not in cur:
            rest: Any = value
            for kk in reversed(key[i + 1:]):
                rest = {kk: rest}
            cur[k] = rest
            return Change("set", key[:i + 1], had_old=False)
        if not isinstance(cur[k], dict):
            raise RuntimeConfigError(f"cannot set {'.'.join(key)}: {k} is not an object",
                                     fix="fix the file by hand")
        cur = cur[k]
    had = key[-1] in cur
    old = json.loads(json.dumps(cur[key[-1]])) if had else None
    cur[key[-1]] = value
    return Change("set", list(key), had, old)


def undo(doc: dict, changes: list[Change]) -> None:
    for ch in reversed(changes):
        if ch.had_old:
            set_key(doc, ch.key, ch.old)
            continue
        cur: Any = doc
        for k in ch.key[:-1]:
            cur = cur.get(k) if isinstance(cur, dict) else None
        if isinstance(cur, dict):
            cur.pop(ch.key[-1], None)


def undo_text(text: str, changes: list[Change], path: str) -> str:
    doc = parse(text, path)
    undo(doc, changes)
    return dumps(doc, text)
