"""`driverd build-matrix`: build every missing cell of a declarative kernel x flavour x driver matrix.

Cells run in parallel up to a job limit; each is reported as built, skipped (the repository holds
it) or failed (with the one-line reason), and a failure never stops the other cells. The repository
index is rewritten at the end so the new packages are fetchable at once. The repository directory and
the compiler cache must be root's (or the building user's) and not group/world-writable (checked:
whoever else could write them could replace a package before it is signed, or plant objects).
"""
from __future__ import annotations

import fnmatch
import os
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from driverd import distro
from driverd.datatypes import dataclass
from driverd.errors import DriverdError, UsageError
from driverd.root import Root
from driverd.runner import Runner

if TYPE_CHECKING:
    from driverd.build.compiler_cache import CompilerCache

_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True)
class Cell:
    """One driver x flavour x kernel cell of a build matrix: the package one build makes."""
    driver: str
    flavor: str
    release: str
    arch: str
    source: str
    distro: str

    @property
    def id(self) -> str:
        return f"{self.driver}-{self.flavor}-{self.release}-{self.arch}"


@dataclass
class Matrix:
    """A build-matrix file as loaded: its cells and the settings that apply to all of them."""
    path: Path
    cells: list[Cell]
    repository: str | None = None
    jobs: int = 1
    make_jobs: int = 0
    headers: dict[str, dict[str, str]] = field(default_factory=dict)

    def headers_hint(self, cell: Cell) -> str:
        h = self.headers.get(cell.distro, {})
        return h.get("install", "").format(release=cell.release)


@dataclass
class CellResult:
    """How one build-matrix cell ended: built, skipped, failed, would-build or interrupted."""
    cell: Cell
    status: str                  # built | skipped | failed | would-build | interrupted
    reason: str = ""
    package: str | None = None
    sha256: str | None = None
    seconds: float = 0.0
    log: str | None = None
    ccache: dict | None = None          # this cell's compiler-cache hits and misses (built cells)

    def to_json(self) -> dict:
        return {"id": self.cell.id, "driver": self.cell.driver, "flavor": self.cell.flavor,
                "kernel_release": self.cell.release, "arch": self.cell.arch, "status": self.status,
                "reason": self.reason, "package": self.package, "sha256": self.sha256,
                "seconds": round(self.seconds, 2), "log": self.log, "ccache": self.ccache}


def load(path: str | os.PathLike) -> Matrix:
    p = Path(path)

    def bad(msg: str) -> UsageError:
        return UsageError(f"matrix {p}: {msg}", fix="see kernels/debian-bookworm.toml for the format")
    try:
        d = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"matrix {p} does not exist", fix="pass a file under kernels/") from None
    except tomllib.TOMLDecodeError as e:
        raise bad(f"not valid TOML ({e})") from None
    cells: list[Cell] = []
    try:
        for drv in d["drivers"]:
            version, flavors, sources = str(drv["version"]), list(drv["flavors"]), dict(drv.get("sources", {}))
            for fl in flavors:
                if fl not in ("open", "proprietary"):
                    raise bad(f"driver {version}: flavor {fl!r} is not open or proprietary")
                if fl not in sources:
                    raise bad(f"driver {version}: no source for the {fl} flavour (sources.{fl})")
            for k in d["kernels"]:
                rel = str(k["release"])
                arch = str(k.get("arch") or _ARCH.get(rel.rsplit("-", 1)[-1], "x86_64"))
                for fl in flavors:
                    cells.append(Cell(version, fl, rel, arch, str(sources[fl]), str(k.get("distro", distro.DEFAULT.name))))
    except (KeyError, TypeError) as e:
        raise bad(f"missing or malformed {e}") from None
    ids = [c.id for c in cells]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise bad(f"cell {dup[0]} appears twice")
    return Matrix(p, cells, d.get("repository"), int(d.get("jobs", 1)), int(d.get("make_jobs", 0)),
                  dict(d.get("headers", {})))


class Progress:
    """A redrawn bar on a terminal: cells done/total, and what each running cell is doing (its phase,
    objects compiled of those expected); one line per event otherwise (CI logs), a cell's phases
    included."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, tty: bool | None = None, enabled: bool = True):
        self.total, self.stream, self.enabled = total, stream, enabled
        self.tty = stream.isatty() if tty is None else tty
        self.done: dict[str, int] = {"built": 0, "skipped": 0, "failed": 0}
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.t0 = time.monotonic()
        self.phases: dict[str, object] = {}          # cell id -> its last buildprogress.Status
        self.drawn = 0.0

    def cell(self, cell: Cell) -> "_CellProgress":
        """What one cell's build reports to (driverd.build.modules's progress)."""
        return _CellProgress(self, cell.id)

    def _status(self, cell_id: str, st) -> None:
        with self.lock:
            old = self.phases.get(cell_id)
            self.phases[cell_id] = st
            if self.tty and not self._json():
                now = time.monotonic()
                if now - self.drawn >= 0.2 or old is None or old.phase != st.phase:
                    self._write("\r\033[K" + self._bar())
                    self.drawn = now
            elif old is None or old.phase != st.phase:
                from driverd.build.progress import Reporter
                self._emit(f"{st.phase:<7} {Reporter.line(st)}", cell=cell_id, status=st.phase,
                           elapsed_s=round(st.elapsed, 1))

    def start(self, cell: Cell) -> None:
        with self.lock:
            self.running.add(cell.id)
            self._emit(f"start   {cell.id}", cell=cell.id, status="start")

    def finish(self, r: CellResult) -> None:
        with self.lock:
            self.running.discard(r.cell.id)
            self.phases.pop(r.cell.id, None)
            self.done[r.status] = self.done.get(r.status, 0) + 1
            detail = r.reason if r.status != "built" else f"{r.package} ({r.seconds:.0f}s)"
            self._emit(f"{r.status:<7} {r.cell.id}" + (f": {detail}" if detail else ""), cell=r.cell.id,
                       status=r.status, reason=r.reason or None, level="warning" if r.status == "failed" else None)

    def _emit(self, line: str, **fields) -> None:
        if not self.enabled:
            return
        n = sum(self.done.values())
        from driverd import log
        if log.format() == "json" and self.stream is sys.stderr:
            log.log(line, progress=f"{n}/{self.total}", **fields)
        elif self.tty:
            self.stream.write("\r\033[K" + line + "\n" + self._bar())
        else:
            self.stream.write(f"[{n}/{self.total}] {line}\n")
        self.stream.flush()

    def _bar(self) -> str:
        from driverd.build.progress import clock
        n = sum(self.done.values())
        width = 24
        fill = int(width * n / max(self.total, 1))
        bar = f"[{'#' * fill}{'.' * (width - fill)}] {n}/{self.total} " \
              f"built {self.done['built']} skipped {self.done['skipped']} failed {self.done['failed']} " \
              f"{clock(time.monotonic() - self.t0)}"
        running = [f"{st.cell.split('-', 1)[-1]}: {st.text()}" for st in self.phases.values()]
        return bar + ("  | " + "; ".join(running) if running else "")

    def _json(self) -> bool:
        from driverd import log
        return log.format() == "json" and self.stream is sys.stderr

    def _write(self, s: str) -> None:
        if self.enabled:
            self.stream.write(s)
            self.stream.flush()

    def close(self) -> None:
        from driverd import log
        if self.enabled and self.tty and not (log.format() == "json" and self.stream is sys.stderr):
            self.stream.write("\n")
            self.stream.flush()


class _CellProgress:
    """One cell's build reporting into the matrix's bar (driverd.build.progress.Sink)."""

    def __init__(self, matrix_progress: Progress, cell_id: str) -> None:
        self.p, self.cell_id = matrix_progress, cell_id

    def status(self, st) -> None:
        self.p._status(self.cell_id, st)

    def message(self, text: str) -> None:
        pass            # the make command line of every cell would drown the bar; it is in the cell's log

    def close(self) -> None:
        pass


def select(matrix: Matrix, only: list[str] | None = None, cell_ids: list[str] | None = None,
           index: int | None = None) -> list[Cell]:
    """The cells a run builds: those matching `only` (globs), in `cell_ids`' order when given (the
    list a rendered Job carries), and of those the one at `index` (a Job's completion index)."""
    cells = [c for c in matrix.cells if not only or any(fnmatch.fnmatch(c.id, g) for g in only)]
    if cell_ids is not None:
        by_id = {c.id: c for c in cells}
        unknown = [i for i in cell_ids if i not in by_id]
        if unknown:
            raise UsageError(f"cell {unknown[0]} is not in {matrix.path}" + (f" (or not matched by {only})" if only else ""),
                             cause="the cell list was made from another version of the matrix",
                             fix="render the Job again from this matrix file")
        cells = [by_id[i] for i in cell_ids]
    if index is not None:
        if not 0 <= index < len(cells):
            raise UsageError(f"--only-index {index} is out of range: {len(cells)} cell(s) to choose from",
                             fix=f"pass an index from 0 to {len(cells) - 1}" if cells else "there is nothing to build")
        cells = [cells[index]]
    return cells


def missing(matrix: Matrix, out: str | os.PathLike, cells: list[Cell] | None = None) -> list[Cell]:
    """The cells the repository directory `out` does not hold (all of them when it does not exist)."""
    from driverd.build.modules import existing
    outp = Path(out)
    cells = matrix.cells if cells is None else cells
    if not outp.is_dir():
        return list(cells)
    return [c for c in cells if existing(outp, c.driver, c.flavor, c.release, c.arch) is None]


def run(matrix: Matrix, out: str | os.PathLike, *, jobs: int | None = None, make_jobs: int | None = None,
        work_dir: str | os.PathLike, only: list[str] | None = None, dry_run: bool = False,
        install_headers: bool = False, sign_key: str | None = None, sign_cert: str | None = None, root: Root | None = None, runner: Runner | None = None,
        progress: Progress | None = None, ccache: CompilerCache | None = None,
        build_fn: Callable[..., object] | None = None, cell_ids: list[str] | None = None,
        only_index: int | None = None, index: bool = True) -> list[CellResult]:
    """Build the selected cells (see select()). index=False leaves the repository index alone: a
    Job's pods each build one cell into a directory of their own, and one indexer takes them in after
    them (driverd.build.intake). Every cell compiles through `ccache` when given, each in a cache of
    its own (compiler_cache.for_cell: no cell trusts what another cell's build stored)."""
    from driverd.build.modules import build, check_out, existing, find_headers
    from driverd.build.compiler_cache import for_cell
    from driverd.repo.index import write_index
    root, runner = root or Root("/"), runner or Runner()
    outp = Path(out)
    check_out(outp)         # before any cell compiles, not once per cell after it did
    cells = select(matrix, only, cell_ids, only_index)
    if not cells:
        raise UsageError(f"no cell of {matrix.path} matches {only}", fix="check --only")
    progress = progress or Progress(len(cells))
    build_fn = build_fn or build
    mj = make_jobs if make_jobs is not None else (matrix.make_jobs or None)

    def one(cell: Cell) -> CellResult:
        t0 = time.monotonic()
        hit = existing(outp, cell.driver, cell.flavor, cell.release, cell.arch)
        if hit is not None:
            r = CellResult(cell, "skipped", "already in the repository", str(hit), hit.name.split(".")[-3])
            progress.finish(r)
            return r
        if dry_run:
            r = CellResult(cell, "would-build", "missing from the repository")
            progress.finish(r)
            return r
        progress.start(cell)
        try:
            try:
                find_headers(root, cell.release)
            except DriverdError:
                hint = matrix.headers_hint(cell)
                if install_headers and hint:
                    runner.run(hint.split(), timeout=1800)
                else:
                    raise
            res = build_fn(source=cell.source, kernel=cell.release, flavor=cell.flavor, out=outp, jobs=mj,
                           work_dir=work_dir, sign_key=sign_key, sign_cert=sign_cert, root=root, runner=runner,
                           progress=progress.cell(cell), ccache=for_cell(ccache, cell.id) if ccache else None)
            r = CellResult(cell, "skipped" if res.cached else "built",
                           "already in the repository" if res.cached else "", str(res.package.path),
                           res.package.sha256, time.monotonic() - t0, res.log, res.ccache)
        except DriverdError as e:
            if runner.cancelled:        # stopped by an interruption, not a failure of the cell: say nothing
                return CellResult(cell, "interrupted", "interrupted", seconds=time.monotonic() - t0)
            hint = matrix.headers_hint(cell) if "headers" in e.message else ""
            reason = e.message + (f" (get them with: {hint})" if hint else "")
            r = CellResult(cell, "failed", reason, seconds=time.monotonic() - t0, log=e.details.get("log"))
        except Exception as e:          # a bug in one cell must not take the others down
            r = CellResult(cell, "failed", f"unexpected {e.__class__.__name__}: {e}", seconds=time.monotonic() - t0)
        progress.finish(r)
        return r

    n = max(1, jobs or matrix.jobs or 1)
    try:
        if n == 1:
            results = [one(c) for c in cells]
        else:
            ex = ThreadPoolExecutor(max_workers=n)
            try:
                results = list(ex.map(one, cells))
            except BaseException:
                # Ctrl-C or SIGTERM reaches this thread only: stop the compiles the workers wait for
                # (each worker's build then removes its own tree) before waiting for the workers.
                runner.cancel()
                ex.shutdown(wait=True, cancel_futures=True)
                raise
            ex.shutdown(wait=True)
    finally:
        progress.close()
    if not index or dry_run:
        return results
    if any(r.status == "built" for r in results) or not (outp / "index.json").exists():
        write_index(outp, runner=runner, verify=False)
    return results
