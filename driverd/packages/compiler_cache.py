"""The compiler cache of `driverd build` and build-matrix: ccache, shared by every build that names the
same directory (a build-matrix Job's pods: one volume).

What a cached object may be reused for is ccache's decision, and ccache keys a compile by what decides
its output: the preprocessed source (every header's text, every -D that changes it), the options that
are not preprocessor options, and the compiler (ccache's manual, "How ccache works"). A new kernel ABI
or a new driver point release therefore recompiles exactly the files whose preprocessed text changed —
which, measured (bench/build_cache.py), is nearly all of them: a stable update of the kernel changes
headers that every file includes (compiler_types.h, force-included into every compile, sched.h,
mm.h...), and a driver point release changes nv-linux.h, which every file of nvidia.ko includes. NVIDIA's
conftest never hits: conftest.sh names each test program after its shell's PID (conftest$$.c), so no
two compiles of a test are alike. Two things would defeat even the reuse that is possible on a kbuild
build, and are handled here:

- absolute paths. Kbuild compiles from the kernel's output tree with absolute paths to the module
  source and the kernel source (-I, -include, the source file itself, and the line markers of the
  preprocessed text, which ccache hashes). Every cell builds in its own directory, and the header
  trees live at per-release paths (/usr/src/linux-headers-6.1.0-47-common, ...-50-common), so no two
  cells would ever share a compile. kernel_view() lays out a view of the header trees beside the
  module source inside the cell directory, and ccache's base_dir (the cell directory) makes those
  paths relative to the compile's working directory: `../../src/nvidia/nv.c`,
  `../source/include/linux/module.h` — the same in every cell, whatever its directory or release.
- the working directory. Kernel objects are built with -g, and ccache then hashes the working
  directory by default (hash_dir): see env().

What is never trusted to the cache: the built modules are checked after every build against the
tree they were built from (driverd.packages.build: vermagic, version, srcversion).
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from driverd.errors import PackageError
from driverd.runner import which

MODES = ("auto", "on", "off")
INSTALL_HINT = "install ccache (Debian/Ubuntu: apt-get install ccache)"


@dataclass(frozen=True)
class CompilerCache:
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
    return CompilerCache(binary, d, max(1, int(max_mb)))


def from_config(root, cfg, work_dir: str | os.PathLike, mode: str | None = None,
                directory: str | None = None) -> CompilerCache | None:
    """The cache a build uses: `mode` and `directory` from the command line (a path on this machine)
    win over build.ccache and build.ccache_dir (a host path, resolved inside `root`); without either,
    the cache lives in the build's work directory, beside everything else a build writes."""
    d = directory or (root.real(cfg["build.ccache_dir"]) if cfg["build.ccache_dir"] else Path(work_dir) / "ccache")
    return resolve(mode or cfg["build.ccache"], d, cfg["build.ccache_max_mb"],
                   where="--ccache" if mode else "build.ccache")


def env(cache: CompilerCache, cell_dir: Path) -> dict[str, str | None]:
    """The environment of one cell's make: ccache's whole configuration, nothing inherited. Each
    setting below says which part of ccache's manual (4.7, Debian bookworm's) it rests on."""
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
        # sloppiness: none (nothing inherited, nothing in the empty config file). The ones kernel
        # builds are usually given — time_macros, include_file_mtime, include_file_ctime — relax checks
        # of the direct mode alone ("The direct mode", "Handling of newly created header files"), which
        # is off below; in the preprocessor mode a __DATE__ is expanded in the text that is hashed (and
        # kbuild compiles with -Werror=date-time anyway).
        # direct_mode false: the direct mode looks a result up by the source file and the headers it
        # read last time, and "header files that were not used, but would have been used if they
        # existed, are not" checked ("The direct mode"). With the paths made the same in every cell,
        # that would reach across cells: a kernel release or driver source that adds a header earlier
        # on the include path, every other input unchanged, would be served the object compiled
        # without it. The preprocessor mode hashes this build's own preprocessed text instead.
        "CCACHE_NODIRECT": "1",
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


def make_variables(cache: CompilerCache, kernel_build: Path) -> list[str]:
    """make variables that put ccache in front of the compiler kbuild would use anyway.

    Debian's header trees choose the kernel's own compiler in `.kernelvariables` (`CC = $(if
    $(DEBIAN_KERNEL_USE_CCACHE),$(CCACHE)) $(CROSS_COMPILE)gcc-12`): that hook is used, so the compiler
    stays the one Debian names. Elsewhere kbuild's default is `$(CROSS_COMPILE)gcc`, and CC on the
    command line is that with ccache in front."""
    try:
        kv = (kernel_build / ".kernelvariables").read_text(errors="replace")
    except OSError:
        kv = ""
    if "DEBIAN_KERNEL_USE_CCACHE" in kv:
        return ["DEBIAN_KERNEL_USE_CCACHE=1", f"CCACHE={cache.binary}"]
    return [f"CC={cache.binary} gcc"]


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
