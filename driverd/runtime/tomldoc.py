"""Round-trip TOML editing with tomlkit: comments, order and layout survive; errors carry line and
column. tomlkit is imported only when a writer edits a file (the runtime modules import this one, and
detect, which reads with tomllib, must never pay for tomlkit)."""
from __future__ import annotations

import copy

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    import tomlkit
    from tomlkit.items import Table

    from driverd.runtime.changes import Change

from driverd.errors import EXIT_USAGE, RuntimeConfigError

MISSING = object()


def parse(text: str, path: str) -> tomlkit.TOMLDocument:
    import tomlkit
    from tomlkit.exceptions import ParseError, TOMLKitError
    try:
        return tomlkit.parse(text)
    except ParseError as e:
        raise RuntimeConfigError(
            f"{path} is not valid TOML (line {e.line}, column {e.col})", cause=str(e).split(" at line")[0],
            fix=f"fix the syntax at {path}:{e.line}:{e.col}; driverd wrote nothing", exit_code=EXIT_USAGE) from None
    except TOMLKitError as e:           # a key defined twice (KeyAlreadyPresent) and friends (found by fuzzing)
        raise RuntimeConfigError(f"{path} is not valid TOML: {' '.join(str(e).split())}",
                                 fix=f"fix {path} (each key once per table); driverd wrote nothing",
                                 exit_code=EXIT_USAGE) from None


def plain(value: Any) -> Any:
    """A tomlkit value as plain Python (dict/list/str/...), deep-copied."""
    if hasattr(value, "unwrap"):
        return value.unwrap()
    return copy.deepcopy(value)


def get(doc: Any, key: list[str], default: Any = None) -> Any:
    cur = doc
    for k in key:
        if not isinstance(cur, dict) or k not in cur:
            return default
        cur = cur[k]
    return cur


def _table(value: dict) -> Table:
    """A (nested) dict as tomlkit tables, with a blank line after so the next header stays readable."""
    import tomlkit
    t = tomlkit.table()
    subs = {k: v for k, v in value.items() if isinstance(v, dict)}
    for k, v in value.items():
        if not isinstance(v, dict):
            t.add(k, v)
    for k, v in subs.items():
        t.add(k, _table(v))
    if not subs:
        t.add(tomlkit.nl())
    return t


def set_key(doc: Any, key: list[str], value: Any) -> Change:
    """Set doc[key...] = value, creating missing tables; returns the change needed to undo it.

    When an ancestor table is missing, the change records that ancestor (undo deletes it whole).
    """
    from driverd.runtime.changes import Change
    cur = doc
    for i, k in enumerate(key[:-1]):
        if k not in cur:
            # Build the rest as one new table so the undo is a single delete.
            rest: Any = value
            for kk in reversed(key[i + 1:]):
                rest = {kk: rest}
            cur[k] = _table(rest) if isinstance(rest, dict) else rest
            return Change("set", key[:i + 1], had_old=False)
        cur = cur[k]
        if not isinstance(cur, dict):
            raise RuntimeConfigError(f"cannot set {'.'.join(key)}: {'.'.join(key[:i + 1])} is not a table",
                                     fix="fix the configuration by hand")
    last = key[-1]
    had = last in cur
    old = plain(cur[last]) if had else None
    cur[last] = _table(value) if isinstance(value, dict) else value
    return Change("set", list(key), had_old=had, old=old)


def delete_key(doc: Any, key: list[str]) -> None:
    cur = doc
    for k in key[:-1]:
        if not isinstance(cur, dict) or k not in cur:
            return
        cur = cur[k]
    if isinstance(cur, dict) and key[-1] in cur:
        del cur[key[-1]]


def remove_key(doc: Any, key: list[str]) -> Change:
    """Delete doc[key...] (which must exist); returns the change that puts it back."""
    from driverd.runtime.changes import Change
    old = plain(get(doc, key))
    delete_key(doc, key)
    return Change("delete", list(key), had_old=True, old=old)


def undo(doc: Any, changes: list[Change]) -> None:
    """Reverse `changes` (last first) on a parsed document, touching nothing else."""
    for ch in reversed(changes):
        if ch.op == "append":
            lst = get(doc, ch.key)
            if isinstance(lst, list) and ch.value in lst:
                lst.remove(ch.value)
        elif ch.op == "delete":
            if get(doc, ch.key, MISSING) is MISSING:      # put back only what is still gone
                set_key(doc, ch.key, ch.old)
        elif ch.had_old:
            set_key(doc, ch.key, ch.old)
        else:
            delete_key(doc, ch.key)
