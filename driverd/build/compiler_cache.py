"""The compiler cache of `driverd build` and build-matrix: ccache, shared by every build that names the
same directory (a build-matrix Job's pods: one volume).

What a cached object may be reused for is ccache's decision. In the depend mode used here (see env())
ccache finds a result by the source file, the compiler's options, the compiler itself and the content
of every header the compiler listed in its dependency file when it stored the result (ccache's manual,
"How ccache works", "The depend mode"); tree_identity() adds the set of files of every tree the headers
come from. A new kernel ABI or a new driver point release therefore recompiles every file that reads a
changed header — which, measured (bench/build_cache.py; docs/testing.md), is nearly all of them: a
stable update of the kernel changes headers every file includes (compiler_types.h, force-included into
every compile, sched.h, mm.h...), and a driver point release changes nv-linux.h, which every file of
nvidia.ko includes. What the cache does give back in full is a rebuild of the same inputs: a retried
Job pod, --rebuild, a repository rebuilt. NVIDIA's conftest is never cached (see _FRONT).

Two things would defeat even that on a kbuild build, and are handled here:

- absolute paths. Kbuild compiles from the kernel's output tree with absolute paths to the module
  source and the kernel source (-I, -include, the source file itself, the dependency file). Every
  cell builds in its own directory, and the header trees live at per-release paths
  (/usr/src/linux-headers-6.1.0-47-common, ...-50-common), so no two cells would ever share a compile.
  kernel_view() lays out a view of the header trees beside the module source inside the cell
  directory, and ccache's base_dir (the cell directory) makes those paths relative to the compile's
  working directory: `../../src/nvidia/nv.c`, `../source/include/linux/module.h` — the same in every
  cell, whatever its directory or release.
- the working directory. Kernel objects are built with -g, and ccache then hashes the working
  directory by default (hash_dir): see env().

What is never trusted to the cache: the built modules are checked after every build against the
tree they were built from (driverd.build.modules: vermagic, version, srcversion).

What a cache may be trusted for, and by whom. ccache keys a result on its inputs, not on who stored it:
whoever can write the cache directory can store any object under another build's key (CCACHE_PREFIX
is not part of the key; with CCACHE_RECACHE it replaces what is there), and that build then links it
into its module — vermagic, version and srcversion come from the sources, so the check above cannot
see it, and a signing build signs it. So a cache is shared only by builds that trust each other:
- a cell's cache is its own (`for_cell`: <dir>/cells/<cell id>; a rendered Job mounts each pod's
  subdirectory of the volume only, driverd.build.job), so a build-matrix cell never reads
  what another cell's pod could have written; what it gets back is a rebuild of its own inputs (a
  retried pod, --rebuild), which is nearly all a cache gives anyway (a new kernel ABI or driver point
  release recompiles almost every file: docs/testing.md);
- the directory is refused unless root (or the user running the build) owns it and every directory
  above it and none is group- or world-writable (driverd.fsutil.trusted_dir): another account could
  otherwise plant objects in it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
from collections import Counter
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.runner import which

MODES = ("auto", "on", "off")
INSTALL_HINT = "install ccache (Debian/Ubuntu: apt-get install ccache)"


@dataclass(frozen=True)
class CompilerCache:
    """The ccache, checked usable and trusted, that a build (or one build-matrix cell) compiles through."""
    binary: str               # the ccache executable
    directory: Path           # CCACHE_DIR
    max_mb: int               # CCACHE_MAXSIZE

    def to_json(self) -> dict:
        return {"binary": self.binary, "dir": str(self.directory), "max_mb": self.max_mb}


def resolve(mode: str, directory: str | os.PathLike, max_mb: int, *, where: str = "build.ccache") -> CompilerCache | None:
    """The cache to build with, or None. auto: ccache when it is installed; on: ccache or a one-line
    error naming the fix; off: none."""
    if mode not in MODES:
        raise PackageError(f"{where} is {mode!r}", cause="it is auto, on or off", fix=f"set {where} to auto, on or off")
    if mode == "off":
        return None
    binary = which("ccache")
    if binary is None:
        if mode == "auto":
            return None
        raise PackageError(f"{where} is on but ccache is not installed", cause="no ccache on PATH",
                           fix=f"{INSTALL_HINT}, or " + ("pass --ccache off" if where == "--ccache"
                                                         else f'set {where} = "auto" or "off"'))
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise PackageError(f"compiler cache directory {d} is not usable: {e.strerror or e}",
                           cause="ccache writes every compile's result there",
                           fix="pass --ccache-dir DIR (a writable directory) or --ccache off") from None
    trusted(d)
    return CompilerCache(binary, d, max(1, int(max_mb)))


def trusted(d: Path) -> None:
    """A cache directory only root (or the user building) can change, on a path only they can change:
    whoever else could write it could store objects under another build's keys (module docstring).
    ConfigError, one line naming the directory and the chown/chmod that fixes it."""
    from driverd.fsutil import trusted_dir
    trusted_dir(d, "compiler cache directory")


def for_cell(cache: CompilerCache, cell_id: str) -> CompilerCache:
    """The cache of one build-matrix cell, <dir>/cells/<cell id>: no cell reads what another one's build
    (another pod of a Job) could have stored (module docstring)."""
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", cell_id).lstrip(".") or "cell"
    d = cache.directory / "cells" / safe
    d.mkdir(parents=True, exist_ok=True)
    trusted(d)
    return CompilerCache(cache.binary, d, cache.max_mb)


def from_config(root, cfg, work_dir: str | os.PathLike, mode: str | None = None,
                directory: str | None = None) -> CompilerCache | None:
    """The cache a build uses: `mode` and `directory` from the command line (a path on this machine)
    win over build.ccache and build.ccache_dir (a host path, resolved inside `root`); without either,
    the cache lives in the build's work directory, beside everything else a build writes."""
    d = directory or (root.real(cfg["build.ccache_dir"]) if cfg["build.ccache_dir"] else Path(work_dir) / "ccache")
    return resolve(mode or cfg["build.ccache"], d, cfg["build.ccache_max_mb"],
                   where="--ccache" if mode else "build.ccache")


def env(cache: CompilerCache, cell_dir: Path, namespace: str) -> dict[str, str | None]:
    """The environment of one cell's make: ccache's whole configuration, nothing inherited. Each
    setting below says which part of ccache's manual (4.7, Debian bookworm's) it rests on.
    `namespace`: tree_identity() of the trees the compiles read."""
    out: dict[str, str | None] = {k: None for k in os.environ if k.startswith("CCACHE_")}
    out.update({
        "CCACHE_DIR": str(cache.directory),
        # "If CCACHE_CONFIGPATH is set it specifies the configuration file, and the system
        # configuration file won't be read": an empty file of ours, so neither /etc/ccache.conf nor a
        # ccache.conf left in a shared cache directory can loosen a setting (ignore_options,
        # sloppiness, hard_link...). The inherited CCACHE_* variables are removed above for the same
        # reason (environment variables outrank every file).
        "CCACHE_CONFIGPATH": str(cell_dir / "ccache.conf"),
        # base_dir: "rewrite absolute paths into paths relative to the current working directory, but
        # only absolute paths that begin with base_dir" ("Compiling in different directories"). The
        # cell directory holds the module source and the kernel_view(), so every path of a compile is
        # relative and the same in every cell; paths outside it (the compiler's own include directory)
        # stay absolute, as the manual advises ("Don't use / as the base directory").
        "CCACHE_BASEDIR": str(cell_dir),
        # hash_dir: "include the current working directory in the hash ... when generating debug info
        # (-g)"; it is there because the CWD "is stored in the debug info". Kbuild compiles with -g from
        # the kernel's output tree, a per-cell directory; driverd strips debug info from every module
        # (`strip --strip-debug`) before packing, so the CWD never reaches a package: hash_dir = false,
        # as "Compiling in different directories" prescribes for -g builds.
        "CCACHE_NOHASHDIR": "1",
        # sloppiness: none (nothing inherited, nothing in the empty config file). time_macros, often
        # given to kernel builds, is not needed: kbuild compiles with -Werror=date-time, so no source
        # that expands __DATE__ or __TIME__ compiles at all. include_file_mtime/ctime would let a header
        # written while a compile reads it be recorded with the wrong content ("Handling of newly
        # created header files"); NVIDIA's conftest writes headers during the build.
        # depend mode: "ccache will not use the preprocessor at all"; a result is found by the source
        # file, the options and the headers the compiler itself listed in its dependency file (kbuild's
        # -Wp,-MMD) when it stored the result ("The depend mode"). The preprocessor mode would run the
        # preprocessor once more for every compile, hit or miss — measured (bench/build_cache.py), a
        # fifth more CPU on a cold build, a third of a rebuild's. What the depend mode, like the direct
        # mode, cannot see is a header that "would have been used if it existed" ("The direct mode"):
        # with the same paths in every cell, a release or source that adds a header earlier on the
        # include path, everything else the same, would be served the object compiled without it.
        # CCACHE_NAMESPACE closes that: see tree_identity(). And with -MMD "ccache will ignore changes
        # in" system headers: a kernel build has one system directory, the compiler's own
        # (-nostdinc -isystem <gcc>/include), which changes with the compiler (compiler_check below).
        "CCACHE_DEPEND": "1",
        "CCACHE_NAMESPACE": namespace,
        # compiler_check content: "Hash the content of the compiler binary". The default (mtime and
        # size) cannot tell two compilers apart in images built with clamped timestamps
        # (SOURCE_DATE_EPOCH), and the cache is shared by pods of whatever image a Job names. (The
        # driver binary, gcc-12, carries its exact version; its cc1 comes from the same package.)
        "CCACHE_COMPILERCHECK": "content",
        # hard_link false: "If the resulting file is modified, the file in the cache will also be
        # modified"; kbuild's objtool rewrites every object file in place after the compile.
        "CCACHE_NOHARDLINK": "1",
        # absolute_paths_in_stderr: "rewrite relative paths in the compiler's standard error output to
        # absolute paths ... if you use base_dir": compiler errors name the files as an uncached build's
        # do, which the one-line failure reason (first_compiler_error) shortens.
        "CCACHE_ABSSTDERR": "1",
        # max_size: the size bound of the cache (and of the volume a Job shares).
        "CCACHE_MAXSIZE": f"{cache.max_mb}Mi",
        # temporary_dir on the cell's own disk: "set temporary_dir to a directory on the local host to
        # avoid NFS traffic for temporary files" ("Sharing a cache on NFS").
        "CCACHE_TEMPDIR": str(cell_dir / "ccache-tmp"),
        # stats_log: "write statistics counter updates to the specified file ... statistics for
        # individual builds": this cell's hits and misses, whatever other cells share the cache.
        "CCACHE_STATSLOG": str(stats_log(cell_dir)),
    })
    (cell_dir / "ccache.conf").write_text("# written by driverd: every setting is in the environment\n")
    return out


def stats_log(cell_dir: Path) -> Path:
    return cell_dir / "ccache-stats.log"


# NVIDIA's conftest.sh names every test program it compiles after its shell's PID (conftest$$.c, with
# -DKBUILD_BASENAME="#conftest$$"): no two are alike, so none is ever served from the cache, and
# through ccache each would cost a preprocessor run more (and a cache entry never read). Several hundred
# of them run in every build; they go to the compiler directly.
_FRONT = """#!/bin/sh
# written by driverd: kbuild's compiler, through ccache except NVIDIA's conftest programs
for a do
  case "${a##*/}" in conftest[0-9]*.c) exec "$@";; esac
done
exec %s "$@"
"""


def front(cache: CompilerCache, cell_dir: Path) -> Path:
    """The command kbuild puts in front of its compiler (see _FRONT), written into the cell."""
    p = cell_dir / "ccache-front"
    p.write_text(_FRONT % shlex.quote(cache.binary))
    p.chmod(0o755)
    return p


def make_variables(front_cmd: Path, kernel_build: Path) -> list[str]:
    """make variables that put `front_cmd` (ccache) in front of the compiler kbuild would use anyway.

    Debian's header trees choose the kernel's own compiler in `.kernelvariables` (`CC = $(if
    $(DEBIAN_KERNEL_USE_CCACHE),$(CCACHE)) $(CROSS_COMPILE)gcc-12`): that hook is used, so the compiler
    stays the one Debian names. Elsewhere kbuild's default is `$(CROSS_COMPILE)gcc`, and CC on the
    command line is that with ccache in front."""
    try:
        kv = (kernel_build / ".kernelvariables").read_text(errors="replace")
    except OSError:
        kv = ""
    if "DEBIAN_KERNEL_USE_CCACHE" in kv:
        return ["DEBIAN_KERNEL_USE_CCACHE=1", f"CCACHE={front_cmd}"]
    return [f"CC={front_cmd} gcc"]


# -- the kernel's header trees at a path that is the same in every cell ----------------------------

def kernel_view(output: Path, source: Path, cell_dir: Path) -> tuple[Path, Path]:
    """The kernel's output tree (SYSOUT) and source tree (SYSSRC) again at cell_dir/kernel/build and
    cell_dir/kernel/source; returns (output, source) of the view.

    Each is a real directory holding a link to every top-level entry of the installed tree (include,
    arch, .config, Module.symvers, ...): kbuild finds the source tree from the real path of the
    directory that holds its Makefile — a link to the whole tree would lead it back to the
    per-release path — while the compiler names a header by the path it opened it through. The output
    tree's reference to its source tree (Debian's one-line Makefile `include <source>/Makefile`,
    kbuild's `source` link) is pointed at the view. Nothing is copied or written into the installed
    trees; kbuild reads them through the view exactly as it reads them directly without a cache."""
    base = cell_dir / "kernel"
    v_out = base / "build"
    same = output.resolve() == source.resolve()
    v_src = v_out if same else base / "source"
    try:
        _link_entries(output, v_out)
        if not same:
            _link_entries(source, v_src)
            _repoint(v_out, output, source, v_src)
    except OSError as e:
        raise PackageError(f"cannot lay out the kernel headers in {base}: {e.strerror or e}",
                           cause="the compiler cache builds against a view of them at a path every cell shares",
                           fix="check the work directory, or build with --ccache off") from None
    return v_out, v_src


def _link_entries(tree: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    for entry in sorted(tree.iterdir()):
        (dest / entry.name).symlink_to(entry.resolve())


def _repoint(v_out: Path, output: Path, source: Path, v_src: Path) -> None:
    mk = v_out / "Makefile"
    try:
        text = mk.resolve().read_text()
    except (OSError, UnicodeDecodeError):
        text = None
    if text is not None:
        new = text
        for old in {str(source), str(source.resolve())}:
            new = re.sub(re.escape(old) + r"(?=/|\s|$)", lambda _: str(v_src), new)
        if new != text:
            mk.unlink()
            mk.write_text(new)
    if (output / "source").is_symlink():
        (v_out / "source").unlink()
        (v_out / "source").symlink_to(v_src)


def tree_identity(*trees: Path) -> str:
    """A name for the set of file paths in `trees` (the kernel's source and output trees and the module
    source: every directory a compile's headers can come from, apart from the compiler's own), used as
    ccache's namespace. The depend mode checks the content of every header a stored result read, but
    not that no new file would now be found before one of them; a file added to or removed from any of
    these trees changes the name, so a result is only ever reused among trees holding the same files.
    Names only: the content of each header that matters is checked by ccache itself. Files a build
    generates (NVIDIA's conftest/ headers) are named by its own scripts, in the module's own
    conftest/ directory, where no installed or shipped file is found."""
    h = hashlib.sha256()
    for t in trees:
        h.update(b"\0tree\0")
        entries = []
        for dirpath, dirnames, filenames in os.walk(t):
            rel = os.path.relpath(dirpath, t)
            entries += [os.path.join(rel, n) for n in filenames]
            entries += [os.path.join(rel, n) + "/" for n in dirnames if os.path.islink(os.path.join(dirpath, n))]
        for e in sorted(entries):
            h.update(os.fsencode(e) + b"\0")
    return "driverd-" + h.hexdigest()[:32]


# -- what one build got from the cache ------------------------------------------------------------

_HIT = ("direct_cache_hit", "preprocessed_cache_hit")
_MISS = ("cache_miss",)
# Counted beside the outcome of a compile (one outcome per compile: a hit, a miss, or a reason it was
# not cacheable), not outcomes themselves.
_DETAIL_PREFIXES = ("local_storage_", "remote_storage_", "direct_cache_miss", "preprocessed_cache_miss")


def build_stats(cell_dir: Path) -> dict[str, int] | None:
    """hits, misses and uncacheable calls of the build in cell_dir, from its ccache stats log (one
    counter name a line, `#` lines name the source file); None without a log."""
    try:
        lines = stats_log(cell_dir).read_text(errors="replace").splitlines()
    except OSError:
        return None
    c = Counter(ln.strip() for ln in lines if ln.strip() and not ln.startswith("#"))
    hits = sum(c[k] for k in _HIT)
    misses = sum(c[k] for k in _MISS)
    other = sum(n for k, n in c.items() if k not in _HIT + _MISS and not k.startswith(_DETAIL_PREFIXES))
    return {"hits": hits, "misses": misses, "uncacheable": other}
