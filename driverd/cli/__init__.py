"""driverd's command line: argument parsing and output only; every decision lives in the subjects.

Command modules register their subcommands; heavy imports happen inside handlers so that
`driverd detect` never pays for the Kubernetes client or the package builder.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys

from driverd import __version__
from driverd.cli.options import Parser
from driverd.errors import EXIT_UNEXPECTED, EXIT_USAGE, DriverdError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

# Each module defines register(sub, common) and handlers taking (ctx, args) -> int.
COMMAND_MODULES = ("driverd.cli.host_cmds", "driverd.cli.package_cmds", "driverd.cli.lifecycle_cmds",
                   "driverd.cli.runtime_cmds", "driverd.cli.daemon_cmds", "driverd.cli.cluster_cmds",
                   "driverd.cli.completion")

EPILOG = """\
exit codes: 0 done or nothing to do, 1 unexpected failure, 2 bad usage or configuration,
            3 blocked by a precondition or another driverd holding the host lock (the message says which),
            4 done what is safe, a reboot is required to finish (apply), 130/143 interrupted (Ctrl-C, SIGTERM)
every command takes --root DIR (default /, the driver container uses /host) and --json.
start with:  driverd detect            what is on this host
             driverd plan --driver V   what driverd would do to reach driver V, and why
more:        driverd --version         which driverd this is
             driverd COMMAND --help    a command's options and examples (also: man driverd)
             driverd completion bash   TAB completion: source <(driverd completion bash)
"""


def common_parser(suppress: bool = False) -> argparse.ArgumentParser:
    """--root/--json/--config, accepted before or after the command name. On subcommands the
    defaults are SUPPRESS so that `driverd --root X plan` keeps X instead of the subcommand's default."""
    p = Parser(add_help=False, argument_default=argparse.SUPPRESS if suppress else None)
    g = p.add_argument_group("common options")
    g.add_argument("--root", metavar="DIR", help="host root directory; every host path is read under it "
                   "(default: $DRIVERD_ROOT or /; the driver container uses /host)")
    g.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    g.add_argument("--config", metavar="FILE", help="config file (default: <root>/etc/driverd/config.toml)")
    g.add_argument("--log-format", choices=("text", "json"), help="logs on stderr: text (default) or one JSON "
                   "object per line with time, level, msg and fields (default: log.format)")
    return p


class _Skipped:
    """Stands in for the parser of a command that this run does not use: building every command's
    parser costs more than a third of `driverd detect`'s start-up, and only one is ever parsed."""
    def __getattr__(self, name: str):
        return lambda *a, **kw: _Skipped()


class _OnlyCommand:
    def __init__(self, sub, name: str) -> None:
        self.sub, self.name = sub, name
        self.only_name = name           # driverd.cli.options.builds reads it

    def add_parser(self, name: str, **kw):
        return self.sub.add_parser(name, **kw) if name == self.name else _Skipped()


_VALUED = ("--root", "--config", "--log-format")


def command_name(argv: list[str]) -> str | None:
    """The subcommand in argv (the first word that is not an option or an option's value)."""
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in _VALUED:
            skip = True
        elif a == "--":
            return None
        elif not a.startswith("-"):
            return a
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser, or (`only`) just that command's: the others are not built."""
    parser = Parser(
        prog="driverd", parents=[common_parser()], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="driverd takes a bare NVIDIA GPU host to workload-ready and keeps it there: it reads the "
                    "host, decides the driver flavour, fetches or builds a package for the exact kernel, "
                    "loads it safely and configures the container runtimes.")
    parser.add_argument("--version", action="version", version=f"driverd {__version__}",
                        help="print driverd's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_parser(suppress=True)
    target = _OnlyCommand(sub, only) if only else sub
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(target, common)
        if only and only in sub.choices:
            break       # the modules after its own are not imported (host_cmds, detect's, comes first)
    if only and only not in sub.choices:
        return build_parser()           # an unknown command: argparse names the choices
    return parser


def _escaping_streams() -> None:
    # Host trees may hold names that are not valid UTF-8 (Python keeps them as surrogates):
    # print them escaped rather than die with UnicodeEncodeError half-way through the output.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="backslashreplace")
            except (ValueError, OSError):
                pass


def main(argv: list[str] | None = None) -> int:
    _escaping_streams()
    words = list(sys.argv[1:] if argv is None else argv)
    return _run(build_parser(command_name(words)), words)


# Whether the command main() ran reads only (its parser's `read_only`): it wrote nothing and left no child.
_read_only = False


def entry() -> NoReturn:
    """`driverd` (the console script) and `python -m driverd`: main(), then the exit. After a read-only
    command (detect, plan, gpus, config, status) the process leaves once its output is flushed, without
    tearing the interpreter down: freeing every module and the GPU table cost `detect` ~15 ms of its
    ~125 (issue 47), and such a command has nothing to close, write or clean up.

    The cyclic garbage collector is paused until the command is known (`_run` starts it again for any
    command that is not read-only): a read-only command ends within a second and frees what it drops by
    reference counting, while the collector's ~25 passes over detect's imports cost ~3 ms of its ~57 here
    and, beside detect's forked NVML child, each pass writes to pages the child still shares."""
    gc.disable()
    rc = main()
    if _read_only:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass                        # a closed pipe: the output is someone else's loss, as in a normal exit
        os._exit(rc)
    sys.exit(rc)


def _output_as_json(words: list[str]) -> list[str] | None:
    """kubectl's `-o json` / `--output json` (and `-ojson`, `--output=json`) as `--json`, for the commands that
    print JSON with --json and take no -o of their own (issue 48: `driverd status -o json` was refused).
    None: no -o json in `words`."""
    out, i, found = [], 0, False
    while i < len(words):
        w = words[i]
        if w in ("-o", "--output") and i + 1 < len(words) and words[i + 1] == "json":
            out.append("--json")
            i, found = i + 2, True
            continue
        if w in ("-ojson", "--output=json"):
            out.append("--json")
            i, found = i + 1, True
            continue
        out.append(w)
        i += 1
    return out if found else None


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """parse_args; a command without an -o of its own takes `-o json` as --json."""
    alias = _output_as_json(words)
    if alias is None:
        return parser.parse_args(words)
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(words)           # the command's own -o (cluster verbs, build-matrix)
    except SystemExit:
        if "-o" not in err.getvalue() and "--output" not in err.getvalue():
            sys.stderr.write(err.getvalue())
            raise
    return parser.parse_args(alias)


def _run(parser: argparse.ArgumentParser, words: list[str]) -> int:
    """Parse `words` and run the command's handler: errors as one line and their exit code."""
    try:
        args = _parse(parser, words)
    except SystemExit as e:   # argparse already printed the usage error
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    global _read_only
    _read_only = bool(getattr(args, "read_only", False))
    if not _read_only:
        gc.enable()                     # entry() paused it; this command may run for days (the daemon)
    if not getattr(args, "handler", None):
        # a group without its verb (`rollout`, `node`): that group's help, not the whole program's
        (getattr(args, "help_of", None) or parser).print_help()
        return EXIT_USAGE
    # A command's work that may start before its configuration is read (detect's NVML child); its
    # release is called however the command ends.
    release = args.early(args) if getattr(args, "early", None) else None
    try:
        return _handle(args)
    finally:
        if release is not None:
            release()


def _handle(args: argparse.Namespace) -> int:
    """The command's handler: errors as one line and their exit code."""
    from driverd.cli.context import Context
    from driverd.cli.output import error

    _configure_logs(args)
    try:
        ctx = Context.from_args(args)
        _configure_logs(args, ctx)
        from driverd.log import log
        for w in getattr(args, "deprecated", None) or ():      # an old spelling (driverd.cli.options)
            log(w, "warning")
        return int(args.handler(ctx, args) or 0)
    except DriverdError as e:
        return error(bool(getattr(args, "json", False)), e)
    except KeyboardInterrupt as e:
        from driverd.cli.interrupt import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated
        term = isinstance(e, Terminated)
        print(f"driverd: {'terminated' if term else 'interrupted'}", file=sys.stderr)
        return EXIT_TERMINATED if term else EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug: say so on one line, with where to look
        import traceback
        if __import__("os").environ.get("DRIVERD_DEBUG"):
            traceback.print_exc()
        from driverd.log import log
        log(f"driverd: unexpected error: {e.__class__.__name__}: {e} (set DRIVERD_DEBUG=1 for a traceback "
            "and report it)", "error", exit_code=EXIT_UNEXPECTED)
        return EXIT_UNEXPECTED


def _configure_logs(args, ctx=None) -> None:
    """--log-format, else log.format (config file or $DRIVERD_LOG_FORMAT); the node's name on every
    JSON event when it is known. A configuration that cannot be loaded is left to the command,
    which reports it."""
    import os
    from driverd import log
    if ctx is None:
        log.reset()
        env = os.environ.get("DRIVERD_LOG_FORMAT")
        log.configure(getattr(args, "log_format", None), pin=True)
        log.configure(env if env in log.FORMATS else None, command=getattr(args, "command", None))
        return
    node = os.environ.get("NODE_NAME")
    try:
        cfg = ctx.config
        log.configure(cfg["log.format"])
        node = cfg["cluster.node_name"] or node
    except DriverdError:
        pass
    log.configure(node=node)


KUBECTL_PROG = "kubectl driverd"


def kubectl_parser() -> argparse.ArgumentParser:
    """The plugin's own parser, named as kubectl users call it: its usage lines and help say
    `kubectl driverd rollout start …`, not `driverd cluster rollout start …`."""
    from driverd.cli import cluster_cmds
    parser = Parser(
        prog=KUBECTL_PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=cluster_cmds.KUBECTL_EPILOG,
        description="Rolling NVIDIA driver upgrades across the cluster the kubeconfig names (the same commands\n"
                    "as `driverd cluster` on a node).\n"
                    "cluster access as kubectl: --kubeconfig, --context, -n; output: -o table|wide|json|yaml|name;\n"
                    "`rollout start --dry-run=client -o yaml` prints the DriverRollout for a GitOps repository.")
    parser.add_argument("--version", action="version", version=f"{KUBECTL_PROG} (driverd {__version__})",
                        help="print the plugin's (driverd's) version and exit")
    sub = parser.add_subparsers(dest="cluster_command", metavar="COMMAND")
    cluster_cmds.register_kubectl(sub, common_parser(suppress=True))
    # what the common options default to where a command does not take them from the command line
    parser.set_defaults(command="cluster", root=None, json=False, config=None, log_format=None)
    return parser


def kubectl_main(argv: list[str] | None = None) -> int:
    """`kubectl driverd ...`: the cluster commands only (rollout, pools, pool, node, nodes). A kubectl
    plugin acts on the cluster the kubeconfig names, never on the workstation it runs on."""
    from driverd.cli import output
    from driverd.cli.cluster_cmds import VALUED_FLAGS
    output.PROG = KUBECTL_PROG          # its errors in its own name, as kubectl's plugins say theirs
    _escaping_streams()
    args = list(sys.argv[1:] if argv is None else argv)
    # kubectl's flags before the command (`kubectl driverd -n driverd nodes`) go after it
    lead: list[str] = []
    while args and args[0].startswith("-") and args[0] not in ("-h", "--help", "--version"):
        lead.append(args.pop(0))
        if lead[-1] in VALUED_FLAGS and args:
            lead.append(args.pop(0))
    if not args:
        kubectl_parser().print_help()
        return EXIT_USAGE
    commands = ("rollout", "pools", "pool", "node", "nodes")
    if args[0] not in (*commands, "-h", "--help", "--version"):
        # name a host command only when driverd has one of that name (`kubectl driverd get` pointed to a
        # `driverd get` that does not exist)
        host = any(isinstance(a, argparse._SubParsersAction) and args[0] in a.choices
                   for a in build_parser(args[0])._actions)
        where = f"; `driverd {args[0]}` is the host command, run on the node" if host else \
            "; `driverd --help` lists the host commands, run on a node"
        print(f"{KUBECTL_PROG}: unknown command {args[0]!r}: {KUBECTL_PROG} acts on the cluster "
              f"({', '.join(commands)}){where}", file=sys.stderr)
        return EXIT_USAGE
    return _run(kubectl_parser(), args + lead)
