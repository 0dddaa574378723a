"""Handlers another tool wrote: recognise NVIDIA's runtime, decide whether driverd takes the handler
over ("adopts" it), and choose the binary the adopted handler runs.

Facts this is built on (nvidia-container-toolkit: cmd/nvidia-ctk/runtime/configure,
cmd/nvidia-ctk-installer/container/operator, pkg/config/engine/*):
- `nvidia-ctk runtime configure` names the handler "nvidia" and, for Docker, writes the binary as the
  bare name "nvidia-container-runtime" (dockerd looks it up in its PATH); for containerd and CRI-O it
  writes /usr/bin/nvidia-container-runtime.
- The GPU Operator's toolkit container adds "nvidia", "nvidia-cdi" and "nvidia-legacy" running
  <toolkit dir>/nvidia-container-runtime, .cdi and .legacy (toolkit dir /usr/local/nvidia/toolkit);
  older toolkit containers also added nvidia-container-runtime-experimental.

Policy: a handler of driverd's name that runs one of those is taken over by default; one that runs
anything else is refused (one line saying what it runs) unless --adopt-foreign / runtime.adopt_foreign.
An adopted handler keeps the NVIDIA runtime it runs (a bare name is resolved on the host's PATH under
the root) unless the operator named a binary (--binary / runtime.binary) or the one it names is missing
while the configured one exists. The original file is backed up once before the first change and the
adoption is recorded, so `revert` gives the other tool's handler back as it wrote it.
"""
from __future__ import annotations

import os
import re

from driverd.datatypes import dataclass
from driverd.errors import RuntimeConfigError
from driverd.root import Root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.runtime.changes import ChangeReport, Options

NVIDIA_RUNTIME = re.compile(r"^nvidia-container-runtime([.-](cdi|legacy|experimental))?$")
# dockerd and the runtimes resolve a bare binary name with PATH; systemd's default PATH for services.
SEARCH_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def is_nvidia_runtime(binary: str | None) -> bool:
    return bool(binary) and bool(NVIDIA_RUNTIME.match(os.path.basename(binary.rstrip("/"))))


def lookup(root: Root, name: str) -> str | None:
    """The absolute host path a bare binary name resolves to on the host's PATH (inside the root)."""
    for d in SEARCH_PATH:
        if root.is_file(f"{d}/{name}"):
            return f"{d}/{name}"
    return None


@dataclass
class Adoption:
    """A runtime handler of NVIDIA's found in place, and the binary driverd makes it run."""
    handler: str
    where: str                   # the file whose handler definition wins
    before: str | None           # the binary it named
    binary: str                  # the binary it runs once driverd has it
    how: str                     # why that binary
    foreign: bool = False

    def to_json(self, file: str | None = None) -> dict:
        return {"handler": self.handler, "file": file or self.where, "before": self.before, "binary": self.binary,
                "how": self.how, "foreign": self.foreign}


def choose_binary(root: Root, current: str | None, opts: Options) -> tuple[str, str]:
    """(binary, how it was chosen) for a handler that runs NVIDIA's `current` binary."""
    if opts.binary_chosen or not current:
        return opts.binary, "the configured binary"
    if not current.startswith("/"):
        found = lookup(root, current)
        if found:
            return found, f"the bare name '{current}' resolved on the host's PATH"
        return opts.binary, f"the bare name '{current}' is not on the host's PATH; the configured binary"
    if root.exists(current) or not root.exists(opts.binary):
        return current, "kept"
    return opts.binary, f"{current} does not exist on the host; the configured binary"


def decide(root: Root, runtime: str, handler: str, where: str, binaries: list[str | None], opts: Options,
           runs: str) -> Adoption:
    """Adopt the existing handler (returns how) or raise the one-line refusal.

    `binaries`: the paths the handler names, the one the runtime executes first; `runs`: what it
    runs, in words, for the refusal."""
    named = [b for b in binaries if b]
    nvidia = next((b for b in named if is_nvidia_runtime(b)), None)
    if nvidia is None:
        if not opts.adopt_foreign:
            raise RuntimeConfigError(
                f"runtime handler '{handler}' already exists in {where} and is not driverd's: it runs {runs}, "
                "not an NVIDIA container runtime",
                cause="driverd takes over only handlers that run nvidia-container-runtime (or its .cdi/.legacy/"
                      "-experimental variants)",
                fix=f"pass --adopt-foreign (runtime.adopt_foreign) to make it run {opts.binary}, or choose another "
                    f"name with --handler; nothing was written", exit_code=3)
        return Adoption(handler, where, named[0] if named else None, opts.binary,
                        "taken over with --adopt-foreign: the configured binary", foreign=True)
    binary, how = choose_binary(root, nvidia, opts)
    return Adoption(handler, where, nvidia, binary, how)


def report_adoption(report: ChangeReport, a: Adoption, handler_files: list[str], rec: dict | None,
                    edits: list) -> None:
    """Say what happened to another tool's handler: taken over (one of `handler_files`, the files its
    new definition goes into, changes), or kept as it is."""
    earlier = bool(rec and a.handler in (rec.get("adopted") or {}))
    changed_files = [f for f in handler_files if any(e.path == f and not e.noop for e in edits)]
    if changed_files:
        report.adopted.append(a.to_json(changed_files[0]))
        return
    if earlier:
        report.notes.append(f"'{a.handler}' in {a.where} (adopted by driverd earlier) runs {a.binary}: "
                            "nothing to change")
    else:
        report.notes.append(f"'{a.handler}' already exists in {a.where} (not added by driverd) and runs "
                            f"{a.binary}; left as it is")
