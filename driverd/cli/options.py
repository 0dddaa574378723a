"""The command line's shared vocabulary: one spelling per concept, the other spellings people type kept
as aliases (issue 32). An alias that changed meaning warns on stderr for one release; an alias that
is merely another spelling (--flavour, --workdir) is accepted silently.

  --flavor / --flavour           the kernel-module flavour, in every command that takes one
  --kernel RELEASE               a kernel release (build, fetch, install, rollback-install)
  --kernel-backend real|sim      the kernel driverd drives (load, unload, reload, rollback, apply,
                                 status); --kernel real|sim there is the deprecated spelling
  --work-dir / --workdir         a working directory (build, build-matrix, demo)
  --rebuild                      build even when --out holds the package (build); --force there is the
                                 deprecated spelling. `rollout start --force` keeps kubectl drain's
                                 meaning: delete the pods whose eviction is refused
"""
from __future__ import annotations

import argparse
import os
import sys

FLAVORS = ("auto", "open", "proprietary")
BACKENDS = ("auto", "real", "sim")
BACKEND_HELP = ("kernel boundary: real (kmod tools; the default, also auto) or sim (the simulated kernel of a host "
                "tree: used only when asked for here or by modules.kernel)")


class Parser(argparse.ArgumentParser):
    """argparse's parser, its help wrapped to the terminal's width without importing shutil for it:
    argparse's HelpFormatter imports shutil (and with it bz2, lzma, zlib, fnmatch) to ask its width at the
    first add_argument, ~2.5 ms of every command's start on a GPU host (issue 47). The subcommands'
    parsers are of this class too (add_subparsers makes them of its parser's class)."""

    def _get_formatter(self):
        return self.formatter_class(prog=self.prog, width=help_width())


def help_width() -> int:
    """What help is wrapped to, as argparse has it: shutil.get_terminal_size()'s columns ($COLUMNS, else
    the terminal on stdout, else 80) less 2."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns
        except (AttributeError, ValueError, OSError):
            columns = 0
    return (columns or 80) - 2


def root_of(args: argparse.Namespace) -> str:
    """The host root a command reads: --root, else $DRIVERD_ROOT, else the command's own default (the
    driver container's /host), else /."""
    return args.root or os.environ.get("DRIVERD_ROOT") or getattr(args, "default_root", None) or "/"


class Deprecated(argparse.Action):
    """An old spelling: stores into the new option's dest and leaves a warning for main() to log (once
    the log format is known), naming the new spelling."""

    def __init__(self, option_strings, dest, *, new: str, why: str = "", **kw) -> None:
        self.new, self.why = new, why
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        warnings = list(getattr(namespace, "deprecated", None) or [])
        warnings.append(f"driverd: warning: {option_string} is deprecated{self.why}: use {self.new}")
        namespace.deprecated = warnings


def add_flavor(p, *, choices: tuple[str, ...] = FLAVORS, help: str | None = None, **kw) -> None:
    p.add_argument("--flavor", "--flavour", dest="flavor", choices=choices, help=help, **kw)


def add_kernel_backend(p) -> None:
    p.add_argument("--kernel-backend", dest="kernel_backend", choices=BACKENDS, help=BACKEND_HELP)
    p.add_argument("--kernel", dest="kernel_backend", choices=BACKENDS, action=Deprecated, new="--kernel-backend",
                   why=" for real|sim (--kernel names a kernel release in build, fetch and install)",
                   help=argparse.SUPPRESS)


def add_work_dir(p, help: str) -> None:
    p.add_argument("--work-dir", "--workdir", dest="work_dir", metavar="DIR", help=help)


def add_ccache(p) -> None:
    """The compiler cache of build and build-matrix (config build.ccache, build.ccache_dir)."""
    p.add_argument("--ccache", choices=("auto", "on", "off"), default=None,
                   help="compile through ccache: auto (when ccache is installed), on (required: exit 3 without "
                   "it), off (default: build.ccache, auto). A compile is served from the cache only when its source, "
                   "options, compiler and every header it read are the same, among header and source trees that "
                   "hold the same files; every module is checked after the build (vermagic, version, srcversion)")
    p.add_argument("--ccache-dir", metavar="DIR", help="the cache directory, a path on this machine; share it "
                   "between builds (and a Job's pods) to reuse their compiles (default: build.ccache_dir, else "
                   "<work dir>/ccache)")


def add_rebuild(p) -> None:
    p.add_argument("--rebuild", action="store_true", help="build even when --out already holds the package")
    p.add_argument("--force", dest="rebuild", nargs=0, action=Deprecated, new="--rebuild", default=False,
                   help=argparse.SUPPRESS)


def builds(sub, name: str) -> bool:
    """Whether `sub` (the subparsers, or the one-command stand-in a run builds) will build command `name`:
    what only its own help needs (the distributions' table, the runtimes') is then not imported at all."""
    only = getattr(sub, "only_name", None)
    return only is None or only == name
