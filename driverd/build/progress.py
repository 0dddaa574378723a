"""What a running `driverd build` is doing: its phase, how long it has run and, while make runs, how
far the compile is — read from kbuild's own output, counted against what the source tree's Kbuild
files say will be compiled.

kbuild facts this relies on (Linux scripts/Makefile.build and Makefile.modfinal, quiet output):
- every C file of a module is one `  CC [M]  <obj>.o` line, and after MODPOST every module's
  generated `<module>.mod.c` is one more `  CC [M]  <module>.mod.o` line;
- every module ends as one `  LD [M]  <module>.ko` line (composite objects also print `LD [M]` for
  `<module>.o`, which is not counted);
- NVIDIA's Makefile runs its conftest first, one `CONFTEST: <name>` line per test; its Kbuild files
  (`Kbuild` including `<module>/<module>.Kbuild`, `<module>-sources.Kbuild`) list every C file in
  `<NAME>_SOURCES` variables, and each module is one `obj-m += <module>.o`.
A plain kbuild tree lists its modules in obj-m and, for a module of several files, the objects in
`<module>-y` / `<module>-objs`. The count is an estimate (a Makefile may filter a file out under a
condition): the total never drops below what was seen.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from driverd.datatypes import dataclass

# in the order a build goes through them
PHASES = ("extract", "copy", "make", "conftest", "compile", "link", "strip", "sign", "pack")
_WORDS = {"extract": "extracting the sources", "copy": "copying the sources", "make": "running make",
          "conftest": "running conftest", "compile": "compiling", "link": "linking",
          "strip": "stripping debug info from", "sign": "signing", "pack": "packing"}

_ASSIGN = re.compile(r"^\s*([A-Za-z0-9_$().-]+)\s*(?:\+|:|\?)?=(.*)$")
_CC = re.compile(r"^\s+CC \[M\]\s+\S+\.o\s*$")
_LD_KO = re.compile(r"^\s+LD \[M\]\s+\S+\.ko\s*$")
_CONFTEST = re.compile(r"^\s*CONFTEST: ")


@dataclass(frozen=True)
class Expected:
    """How many objects and modules a full compile of a source tree makes, as its Kbuild files say."""
    objects: int | None          # `CC [M]` lines a full compile prints (sources + one .mod.o per module)
    modules: int | None          # `.ko` files it links


def _kbuild_files(tree: Path) -> list[Path]:
    files = [tree / "Kbuild"] if (tree / "Kbuild").is_file() else []
    files += sorted(tree.glob("*.Kbuild")) + sorted(tree.glob("*/*.Kbuild")) + sorted(tree.glob("*/Kbuild"))
    return files


def expected(tree: Path) -> Expected:
    """How many objects and modules the Kbuild files of `tree` name (None where they name none)."""
    sources: list[str] = []
    modules: list[str] = []
    parts: dict[str, list[str]] = {}
    for f in _kbuild_files(tree):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for ln in text.replace("\\\n", " ").splitlines():
            m = _ASSIGN.match(ln)
            if not m or ln.lstrip().startswith("#"):
                continue
            var, words = m.group(1), m.group(2).split("#", 1)[0].split()
            if var.endswith("_SOURCES"):
                sources += [w for w in words if w.endswith(".c")]
            elif var == "obj-m":
                modules += [w[:-2] for w in words if w.endswith(".o")]
            elif var.endswith("-y") or var.endswith("-objs"):
                parts.setdefault(var.rsplit("-", 1)[0], []).extend(w for w in words if w.endswith(".o"))
    if not modules:
        return Expected(None, None)
    n_src = len(set(sources)) if sources else sum(len(parts.get(mod) or [mod]) for mod in modules)
    return Expected(n_src + len(modules), len(modules))


@dataclass(frozen=True)
class Status:
    """One progress report of a running build: its phase, time so far and how far the phase is."""
    cell: str
    phase: str
    elapsed: float                 # seconds since the build started
    done: int | None = None        # objects compiled or modules linked or signed, in this phase
    total: int | None = None

    def text(self) -> str:
        what = _WORDS.get(self.phase, self.phase)
        if self.done is not None and self.phase in ("compile", "link", "strip", "sign", "conftest"):
            unit = {"compile": "objects", "conftest": "tests"}.get(self.phase, "modules")
            what += f" {self.done}/{self.total} {unit}" if self.total else f" ({self.done} {unit})"
        return what


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Kbuild:
    """The phase and counts of one make run, from its output lines."""

    def __init__(self, exp: Expected) -> None:
        self.exp = exp
        self.phase = "make"
        self.compiled = self.linked = self.tests = 0

    def feed(self, line: str) -> bool:
        """Take one line of make's output; True when the phase or a count changed."""
        if _CC.match(line):
            self.compiled += 1
            if self.phase != "link":
                self.phase = "compile"
            return True
        if _LD_KO.match(line):
            self.linked += 1
            self.phase = "link"
            return True
        if _CONFTEST.match(line) and self.phase in ("make", "conftest"):
            self.tests += 1
            self.phase = "conftest"
            return True
        return False

    def counts(self) -> tuple[int | None, int | None]:
        if self.phase == "compile":
            total = self.exp.objects
            return self.compiled, max(total, self.compiled) if total else None
        if self.phase == "link":
            total = self.exp.modules
            return self.linked, max(total, self.linked) if total else None
        if self.phase == "conftest":
            return self.tests, None
        return None, None


class Sink:
    """Where a build reports what it is doing and its make command line; this one says nothing."""

    def status(self, st: Status) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class Reporter(Sink):
    """Prints a build's progress on stderr: on a terminal one line redrawn in place (phase, counts,
    a bar, elapsed time); otherwise a line per phase and, while one phase lasts, one every
    `heartbeat_s` (CI logs, journald); with --log-format json, those as events."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, heartbeat_s: float = 30.0) -> None:
        self.stream = stream or sys.stderr
        try:
            self.tty = self.stream.isatty() if tty is None else tty
        except (AttributeError, ValueError):
            self.tty = False
        self.heartbeat_s = heartbeat_s
        self.lock = threading.Lock()
        self.last: Status | None = None
        self.printed = 0.0
        self.drawn = False

    def status(self, st: Status) -> None:
        with self.lock:
            now = time.monotonic()
            new_phase = self.last is None or st.phase != self.last.phase or st.cell != self.last.cell
            if self.tty and not self._json():
                if new_phase or now - self.printed >= 0.1 or (st.total and st.done == st.total):
                    self._write("\r\033[K" + self.line(st, bar=True))
                    self.drawn, self.printed = True, now
            elif new_phase or now - self.printed >= self.heartbeat_s:
                self._event(st)
                self.printed = now
            self.last = st

    def message(self, text: str) -> None:
        """A line of its own (the make command line), kept above the redrawn one."""
        with self.lock:
            if self.tty and not self._json():
                self._write("\r\033[K" + text + "\n")
                if self.last is not None:
                    self._write(self.line(self.last, bar=True))
            elif self.stream is sys.stderr:
                from driverd import log
                log.log(text)
            else:
                self._write(text + "\n")

    def close(self) -> None:
        with self.lock:
            if self.drawn:
                self._write("\n")
                self.drawn = False

    @staticmethod
    def line(st: Status, bar: bool = False) -> str:
        s = f"{st.cell}: {st.text()}"
        if bar and st.total:
            width = 20
            fill = int(width * min(st.done or 0, st.total) / st.total)
            s += f" [{'#' * fill}{'.' * (width - fill)}]"
        return s + f" ({clock(st.elapsed)})"

    def _json(self) -> bool:
        from driverd import log
        return log.format() == "json" and self.stream is sys.stderr

    def _event(self, st: Status) -> None:
        from driverd import log
        if self.stream is sys.stderr:
            log.log(self.line(st), phase=st.phase, cell=st.cell, elapsed_s=round(st.elapsed, 1), done=st.done,
                    total=st.total)
        else:
            self._write(self.line(st) + "\n")

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):
            pass

