"""The small JSONPath subset printer columns use: .a.b, ['a'], [n], [*], [?(@.k=="v")] and [?(@.k)]."""
from __future__ import annotations

import re

_TOK = re.compile(r"""\.([A-Za-z0-9_\-$/]+)|\[\s*'([^']*)'\s*\]|\[\s*"([^"]*)"\s*\]|\[(-?\d+)\]|\[\*\]|\.\*"""
                  r"""|\[\?\(@((?:\.[A-Za-z0-9_\-]+)+)\s*(?:(==|!=)\s*(?:"([^"]*)"|'([^']*)'|([^)\s]+)))?\s*\)\]""")


def parse(expr: str) -> list:
    expr = expr.strip()
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = expr.removeprefix("$")
    if expr and not expr.startswith((".", "[")):
        expr = "." + expr
    toks, pos = [], 0
    while pos < len(expr):
        m = _TOK.match(expr, pos)
        if not m:
            raise ValueError(f"unrecognized JSONPath {expr!r} at {pos}")
        if m.group(1) is not None:
            toks.append(("field", m.group(1)))
        elif m.group(2) is not None or m.group(3) is not None:
            toks.append(("field", m.group(2) if m.group(2) is not None else m.group(3)))
        elif m.group(4) is not None:
            toks.append(("index", int(m.group(4))))
        elif m.group(5) is not None:
            val = next((g for g in (m.group(7), m.group(8), m.group(9)) if g is not None), None)
            toks.append(("filter", m.group(5)[1:].split("."), m.group(6), val))
        else:
            toks.append(("all",))
        pos = m.end()
    return toks


def find(obj, expr) -> list:
    toks = parse(expr) if isinstance(expr, str) else expr
    cur = [obj]
    for t in toks:
        nxt = []
        for c in cur:
            if t[0] == "field":
                if isinstance(c, dict) and t[1] in c:
                    nxt.append(c[t[1]])
            elif t[0] == "index":
                if isinstance(c, list) and -len(c) <= t[1] < len(c):
                    nxt.append(c[t[1]])
            elif t[0] == "all":
                if isinstance(c, list):
                    nxt.extend(c)
                elif isinstance(c, dict):
                    nxt.extend(c.values())
            elif t[0] == "filter" and isinstance(c, list):
                for item in c:
                    v = item
                    for f in t[1]:
                        v = v.get(f) if isinstance(v, dict) else None
                    if t[2] is None:
                        ok = v is not None
                    else:
                        sv = ("true" if v else "false") if isinstance(v, bool) else (None if v is None else str(v))
                        ok = (sv == t[3]) if t[2] == "==" else (sv != t[3])
                    if ok:
                        nxt.append(item)
        cur = nxt
    return cur
