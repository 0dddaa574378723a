"""driverd's logs: one event a line on stderr, as text (the default) or as JSON objects
(`--log-format json`, `log.format`, $DRIVERD_LOG_FORMAT).

Text is what a person reads: the message alone for a command, the time first for the daemon's
modes (`configure(timestamps=True)`: a log file or `kubectl logs` has no other), except where stderr
is the journal, which stamps every line itself ($JOURNAL_STREAM names it); an error's kernel log
lines (`kernel_log`) follow its line, indented, one each. JSON is one object
per line for log collectors: `time` (RFC 3339, UTC, milliseconds), `level` (info, warning, error),
`msg`, then fields: what the call passed (`reason`, `state`, ...), what the code running it bound
with `fields(...)` (the executor binds `step`, `run_id` and `command` around each step), and the
process-wide ones set by `configure(...)` (`node`, `command`, `mode`).

Results never go through here: they are the command's output on stdout.
No dependency beyond the standard library: every command imports this.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar

from driverd.redact import redact

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Iterator, TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")

_lock = threading.Lock()
_state: dict[str, Any] = {"format": "text", "pinned": False, "static": {}, "stream": None, "timestamps": False}
# fields whose list of lines text prints under the message, indented, instead of leaving them out
_TEXT_LINES = ("kernel_log",)
_bound: ContextVar[dict] = ContextVar("driverd_log_fields", default={})
# "driverd: warning: x", "driverd daemon: x", "warning: x", "  ! step failed: x"
_PREFIX = re.compile(r"^driverd(?: (?P<component>[a-z][a-z-]*))?: ")
_LEVEL_PREFIX = re.compile(r"^(?P<level>warning|error): ")


def configure(fmt: str | None = None, *, pin: bool = False, stream: TextIO | None = None,
              timestamps: bool | None = None, **static: Any) -> None:
    """Set the format (a pinned one - from the command line - is kept when the configuration names
    another), whether text lines start with the time, and process-wide fields (None removes one)."""
    with _lock:
        if timestamps is not None:
            _state["timestamps"] = timestamps
        if fmt is not None and fmt in FORMATS and (pin or not _state["pinned"]):
            _state["format"] = fmt
            _state["pinned"] = _state["pinned"] or pin
        if stream is not None:
            _state["stream"] = stream
        for k, v in static.items():
            if v is None:
                _state["static"].pop(k, None)
            else:
                _state["static"][k] = v


def reset() -> None:
    """Back to the defaults (tests, and a CLI main() called twice in one process)."""
    with _lock:
        _state.update(format="text", pinned=False, static={}, stream=None, timestamps=False)


def format() -> str:          # noqa: A001  (the module's vocabulary: log.format)
    return _state["format"]


@contextmanager
def fields(**kw: Any) -> Iterator[None]:
    """Fields added to every event logged inside the block, in this thread or task."""
    token = _bound.set({**_bound.get(), **{k: v for k, v in kw.items() if v is not None}})
    try:
        yield
    finally:
        _bound.reset(token)


def stderr_is_journal() -> bool:
    """Whether stderr is systemd's journal stream (systemd.exec(5): $JOURNAL_STREAM is "DEV:INODE" of
    the stream it connected; a process that inherited the variable but writes elsewhere does not match)."""
    import os
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(2)
    except OSError:
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def _now() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def record(msg: str, level: str | None = None, **kw: Any) -> dict:
    """The JSON object of one event (also what tests assert on)."""
    bound = dict(_bound.get())
    level = level or bound.pop("level", None)
    bound.pop("level", None)
    text = msg.strip()
    component = None
    m = _PREFIX.match(text)
    if m:
        component = m.group("component")
        text = text[m.end():]
    m = _LEVEL_PREFIX.match(text)
    if m:
        level = level or m.group("level")
        text = text[m.end():]
    if text.startswith("! "):              # the executor's failed step
        level = level or "error"
    if level == "warn":
        level = "warning"
    rec: dict[str, Any] = {"time": _now(), "level": level if level in LEVELS else "info", "msg": text}
    if component:
        rec["component"] = component
    for src in (_state["static"], bound, kw):
        for k, v in src.items():
            if v is not None and k not in ("time", "level", "msg"):
                rec[k] = v
    return rec


def log(msg: str, level: str | None = None, **kw: Any) -> None:
    """Log one event; never raises (a closed stderr must not turn a result into a failure)."""
    stream = _state["stream"] or sys.stderr
    try:
        if _state["format"] == "json":
            line = json.dumps(record(msg, level, **kw), default=str, ensure_ascii=False)
        else:
            line = (_now() + " " + msg) if _state["timestamps"] else msg
            for name in _TEXT_LINES:
                extra = kw.get(name, _bound.get().get(name))
                if isinstance(extra, (list, tuple)):
                    line += "".join("\n    " + " ".join(str(x).splitlines()) for x in extra)
        line = redact(line)             # stderr is the systemd journal / container log: no URL credentials
        with _lock:
            stream.write(line + "\n")
            stream.flush()
    except (OSError, ValueError):
        pass


def info(msg: str, **kw: Any) -> None:
    log(msg, "info", **kw)


def warning(msg: str, **kw: Any) -> None:
    log(msg, "warning", **kw)


def error(msg: str, **kw: Any) -> None:
    log(msg, "error", **kw)
