"""What every command gets: the host root, the validated configuration, output mode, the runner.
This is also the composition root: the one place that decides to bring in the simulated backends
(driverd.sim) — only when asked for: --kernel-backend sim or modules.kernel = "sim"."""
from __future__ import annotations

import os
from functools import cached_property

from driverd import config as config_mod
from driverd.cli.options import root_of
from driverd.datatypes import dataclass
from driverd.errors import UsageError
from driverd.root import Root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.runner import Runner

# Commands whose answer is the host's facts (the others use --root for a few paths only).
_HOST_COMMANDS = {"detect", "plan", "load", "unload", "reload", "rollback", "apply", "status", "debug", "daemon", "reboot-ready",
                  "container-entrypoint"}


@dataclass
class Context:
    """What every command handler gets: the host root, output mode and the configuration."""
    root: Root
    json: bool
    dry_run: bool
    config_path: str | None

    @cached_property
    def config(self) -> config_mod.Config:
        return config_mod.load(self.root, self.config_path)

    @cached_property
    def runner(self) -> Runner:
        from driverd.runner import Runner      # not at import: the read-only commands run nothing
        return Runner(dry_run=self.dry_run)

    def step_context(self, cfg=None, kernel_choice: str | None = None):
        """The context steps run in, with the kernel and service backends for this root."""
        from driverd.apply.lifecycle import make_context
        cfg = cfg or self.config
        choice = kernel_choice or cfg["modules.kernel"]
        if wants_sim(choice):
            from driverd.sim import install_backends
            install_backends()
        return make_context(self.root, self.runner, cfg, choice)

    @classmethod
    def from_args(cls, args) -> "Context":
        # a common option this command would ignore (refused_common: option -> (cause, fix))
        for opt, (cause, fix) in getattr(args, "refused_common", {}).items():
            if getattr(args, opt.lstrip("-").replace("-", "_"), None) is not None:
                raise UsageError(f"driverd {args.command} does not take {opt}", cause=cause, fix=fix)
        # container-entrypoint defaults to /host (the driver container's mount of the host root)
        root = root_of(args)
        check_root(root, getattr(args, "command", None))
        return cls(Root(root), bool(args.json), bool(getattr(args, "dry_run", False)), args.config)


def wants_sim(choice: str | None) -> bool:
    """Only an explicit --kernel-backend sim / modules.kernel = "sim" brings in the simulated backends."""
    return choice == "sim"


# What every host root has and a directory that merely holds host trees has not: the kernel's views (a
# live host, the driver container's /host, a captured or simulated tree all carry proc/ and sys/) and the
# OS's identity (etc/os-release, or usr/lib/os-release it links to).
ROOT_MARKERS = ("proc", "sys", "etc/os-release", "usr/lib/os-release")
_FIX_ROOT = "pass the directory holding the host's root file system (/ on a host, /host in the driver container)"


def looks_like_root(path: str) -> bool:
    return any(os.path.lexists(os.path.join(path, m)) for m in ROOT_MARKERS)


def check_root(path: str, command: str | None) -> None:
    """A --root that is not a directory, or (for the commands that read the host) one with none of what
    a host root has, is bad usage (exit 2): every fact read under it would be "absent", and a plan of
    "no NVIDIA GPU on this host" is wrong, not empty. The fix names a directory below that looks like a
    root (--root one level too high)."""
    if not os.path.exists(path):
        raise UsageError(f"--root {path} does not exist", fix=_FIX_ROOT)
    if not os.path.isdir(path):
        raise UsageError(f"--root {path} is not a directory", fix=_FIX_ROOT)
    if os.path.abspath(path) == "/" or command not in _HOST_COMMANDS or looks_like_root(path):
        return
    below = []
    try:
        with os.scandir(path) as it:
            for i, e in enumerate(it):
                if i >= 1000:
                    break
                if e.is_dir(follow_symlinks=False) and looks_like_root(e.path):
                    below.append(e.path)
    except OSError:
        pass
    raise UsageError(f"--root {path} is not a host's root: it has no proc, sys or etc/os-release",
                     fix=(f"pass --root {sorted(below)[0]}, which looks like one" if len(below) == 1 else
                          f"pass one of the directories below it that look like one: {', '.join(sorted(below)[:5])}"
                          if below else _FIX_ROOT))
