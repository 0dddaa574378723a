"""depmod and `modprobe --show-depends` for the simulated kernel: no kmod needed, so the demo and the
simulated hosts run on a machine without it.

kmod's depmod computes a module's dependencies from symbols (what it imports that another module
exports); the `depends=` string in the module's `.modinfo` is the same list, written by the kernel
build's modpost from those symbols. Here it is read from `.modinfo` (driverd.modinfo). The output is
depmod's `modules.dep` text format (man modules.dep(5)), compared with the real depmod's output on the
same trees in tests/test_sim_depmod.py:

    <path of the module, relative to /lib/modules/RELEASE>: <dep path> <dep path> ...

one line per module file under /lib/modules/RELEASE (depmod skips directories named build and
source at any depth), each listing the module's dependencies transitively, every module before the
modules it depends on (modprobe inserts the list from its end). A dependency that no module file in
the tree provides is left out (as depmod does for a symbol nothing exports). When two files carry the
same module name, the one under updates/ wins over any other location (depmod's built-in search
order "updates built-in", depmod.d(5)); between two other locations depmod keeps whichever its
directory walk meets first (readdir order, so arbitrary), the simulation the first in path order.
depmod.d configuration (search, override, external) is not read. The order of the lines differs
too (depmod's follows modules.order and readdir; here path order) — nothing reads it.

Only modules.dep is written; the other indexes depmod writes (modules.alias, modules.symbols, the
.bin files) are read by nothing in the simulation.
"""
from __future__ import annotations

import os
from pathlib import Path

from driverd.modinfo import module_name, read_modinfo

SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")
SKIP_DIRS = ("build", "source")


def module_files(base: Path) -> dict[str, str]:
    """module name -> path relative to `base` (/lib/modules/RELEASE), duplicates resolved."""
    found: dict[str, list[str]] = {}
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for f in sorted(files):
            if f.endswith(SUFFIXES):
                rel = os.path.relpath(os.path.join(dirpath, f), base)
                found.setdefault(module_name(f), []).append(rel)
    return {name: min(paths, key=lambda p: (not p.startswith("updates/"), p)) for name, paths in found.items()}


def dependency_lines(base: Path) -> list[str]:
    """modules.dep lines for the module tree at `base`. Raises ValueError/OSError for a module file
    that cannot be read (depmod refuses a tree with a damaged module too)."""
    files = module_files(base)
    direct: dict[str, list[str]] = {}
    for name, rel in files.items():
        try:
            info = read_modinfo(base / rel)
        except ValueError as e:
            raise ValueError(f"{rel}: {e}") from None
        direct[name] = sorted({d for d in info.depends if d in files and d != name})
    lines = []
    for name, rel in sorted(files.items(), key=lambda kv: kv[1]):
        lines.append(f"{rel}:" + "".join(f" {files[d]}" for d in _users_first(name, direct)))
    return lines


def _users_first(name: str, direct: dict[str, list[str]]) -> list[str]:
    """Every module `name` needs, transitively, each before the modules it needs (reverse post-order
    of a depth-first walk; a dependency cycle, which the kernel cannot load, is cut where it closes)."""
    post: list[str] = []
    seen = {name}
    stack: list[tuple[str, int]] = [(name, 0)]
    while stack:
        cur, i = stack.pop()
        deps = direct.get(cur, [])
        if i < len(deps):
            stack.append((cur, i + 1))
            d = deps[i]
            if d not in seen:
                seen.add(d)
                stack.append((d, 0))
        elif cur != name:
            post.append(cur)
    return post[::-1]


def parse_dep_line(line: str) -> tuple[str, list[str]] | None:
    path, sep, deps = line.partition(":")
    return (path.strip(), deps.split()) if sep else None


def show_depends(base: Path, dep_text: str, name: str) -> list[str] | None:
    """What `modprobe --show-depends name` inserts, from modules.dep text: paths relative to `base`,
    dependencies first, `name` last; None when modules.dep has no such module."""
    want = name.replace("-", "_")
    for line in dep_text.splitlines():
        parsed = parse_dep_line(line)
        if parsed and module_name(parsed[0]) == want:
            path, deps = parsed
            return [*reversed(deps), path]
    return None
