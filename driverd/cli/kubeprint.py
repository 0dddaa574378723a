"""How the cluster commands (cluster_cmds.py, pool_cmds.py) print: kubectl's -o formats, and what
a node wrote shown so that it cannot drive the terminal."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

WATCH_S = 2.0           # how often -w reads again: a rollout's node moves on in seconds, not in milliseconds


def _fmt(args) -> str:
    return args.output or ("json" if getattr(args, "json", False) else "table")


def _shown(text: object, keep: str = "") -> str:
    """What a node wrote (its reason, message, driver annotations: any holder of that node's credential
    writes them) as a terminal may show it: control and format characters — escape sequences that move
    the cursor, retitle the window or hide lines, bidirectional overrides — written as \\xNN / \\uNNNN
    instead of being sent to the terminal. `keep`: the line breaks of driverd's own layout."""
    import unicodedata
    out = []
    for ch in str(text):
        if ch in keep or unicodedata.category(ch)[0] != "C":
            out.append(ch)
        else:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return "".join(out)


def _cells(rows: list[list]) -> list[list[str]]:
    return [[_shown(c) for c in r] for r in rows]


def _print(args, data, human, *, wide=None, names: list[str] | None = None) -> None:
    """-o: json, yaml, name (`names`, KIND/NAME lines), wide (`wide`, else the table), table (`human`)."""
    f = _fmt(args)
    if f == "json":
        print(json.dumps(data, indent=2, sort_keys=True, default=str))
    elif f == "yaml":
        import yaml
        print(yaml.safe_dump(data, sort_keys=False, default_flow_style=False).rstrip())
    elif f == "name" and names is not None:
        if names:
            print("\n".join(names))
    else:
        h = wide if f == "wide" and wide is not None else human
        print(_shown(h(data) if callable(h) else h, keep="\n"))


def dry_said(args) -> str:
    """The suffix kubectl puts on what a dry run would have done ("" for a real run)."""
    return {"client": " (dry run)", "server": " (server dry run)"}.get(getattr(args, "dry_run", "none"), "")


def _rollout_name(name: str) -> str:
    return f"driverrollout.driverd.io/{name}"


def _yaml(d) -> str:
    import yaml
    return yaml.safe_dump(d, sort_keys=False).rstrip()


def add_watch(p, what: str) -> None:
    """kubectl's -w for a listing, with --timeout as rollout status has it."""
    p.add_argument("--watch", "-w", action="store_true",
                   help=f"print {what} again whenever it changes, until interrupted (Ctrl-C) or --timeout")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --watch: give up after this")


def watching(args, once: Callable[[], int | None]) -> int:
    """Print once; with -w, read and print again whenever what would be printed changes (a blank line between
    two pictures, as kubectl's table watch starts a new block), until interrupted (exit 0) or --timeout."""
    import contextlib
    import io
    import time
    if not getattr(args, "watch", False):
        return once() or 0
    last = None
    end = time.monotonic() + args.timeout if getattr(args, "timeout", None) else None
    try:
        while True:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                once()
            if buf.getvalue() != last:
                if last is not None:
                    sys.stdout.write("\n")
                sys.stdout.write(buf.getvalue())
                sys.stdout.flush()
                last = buf.getvalue()
            if end is not None and time.monotonic() >= end:
                return 0
            time.sleep(WATCH_S if end is None else max(0.0, min(WATCH_S, end - time.monotonic())))
    except KeyboardInterrupt:
        return 0
