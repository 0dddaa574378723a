"""Output only: human text by default, JSON with --json. Results go to stdout, logs/errors to stderr."""
from __future__ import annotations

import json
import sys

from driverd.errors import DriverdError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable


def emit(as_json: bool, data: dict, human: Callable[[dict], str] | str) -> None:
    if as_json:
        json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    else:
        text = human(data) if callable(human) else human
        if text:
            sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


PROG = "driverd"         # the program errors are said in the name of: "kubectl driverd" for the plugin


def error(as_json: bool, err: DriverdError) -> int:
    if as_json:
        json.dump(err.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    from driverd import log as logs
    kernel_log = err.details.get("kernel_log")
    logs.log(f"{PROG}: error: {err.one_line()}", "error", error=err.message, cause=err.cause, fix=err.fix,
             exit_code=err.exit_code, kernel_log=kernel_log if isinstance(kernel_log, list) and kernel_log else None)
    return err.exit_code


def log(msg: str, **fields: Any) -> None:
    from driverd import log as logs
    logs.log(msg, **fields)


def yesno(v: Any) -> str:
    return {True: "yes", False: "no", None: "unknown"}.get(v, str(v))


def table(rows: list[list[str]], indent: str = "  ") -> str:
    if not rows:
        return ""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
