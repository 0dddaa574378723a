"""`driverd` (the console script) and `python -m driverd`: the command line, driverd.cli.

Before it, for a plain `driverd detect` of the live host, the children whose answers detect waits for
start here (driverd.host.start_early): NVML's report and the pass over every process. Importing the
command line and building its parser takes 5-14 ms of a GPU host's start-up before the command's own
early hook can run, and NVML's child (pynvml's import, nvmlInit, the queries) is the last to answer on a
fast host and on one with several GPUs (issue 47). The hook still runs once the command line is read: it
keeps the children where they are what the parsed command asks for and dismisses them otherwise.
"""
from __future__ import annotations

# What a plain detect's command line may hold besides `detect`: no --root (the live host is /), nothing
# whose meaning only argparse knows (an abbreviation, a --config). Any other line starts nothing here.
_PLAIN_DETECT = frozenset({"--json", "--no-nvml", "-o", "--output", "json", "-ojson", "--output=json"})


def _start_for(words: list[str]):
    """start_early's release where `words` are a plain detect of the live host; None otherwise."""
    import os
    if words.count("detect") != 1 or not set(words) - {"detect"} <= _PLAIN_DETECT:
        return None
    if os.path.abspath(os.environ.get("DRIVERD_ROOT") or "/") != "/":     # root_of's fallback
        return None
    from driverd.host import start_early
    return start_early("/", nvml="--no-nvml" not in words)


def entry() -> None:
    import gc
    import sys
    gc.disable()                        # as driverd.cli.entry does from its start (it says why)
    release = _start_for(sys.argv[1:])
    try:
        from driverd.cli import entry as command_line
        command_line()
    finally:
        if release is not None:         # the command failed before it took them (a usage error)
            release()


if __name__ == "__main__":
    entry()
