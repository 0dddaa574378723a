"""Read-only checks of driverd against a real GPU host (run by hand on a GPU machine, not by pytest).

Never loads, unloads or reconfigures anything: it reads facts, validates the loaded driver through
the real-kernel boundary with a dry-run runner, lists holders while a CUDA process holds the GPU,
and records the MIG layout. Prints one JSON document.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback


def main() -> int:
    from driverd.host import collect
    from driverd.kmod import holders, load, mig
    from driverd.kmod.kernel import select_kernel
    from driverd.root import Root
    from driverd.runner import Runner

    out: dict = {}
    root = Root("/")
    runner = Runner(dry_run=True)       # anything that would change the host is recorded, not run
    kernel = select_kernel(root, runner, "real")
    holder_proc = None
    try:
        holder_proc = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.zeros(1, device='cuda'); "
                                        "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        out["cuda_holder_ready"] = holder_proc.stdout.readline().strip() == "ready"
    except Exception as e:  # torch missing: holders are checked without a CUDA user
        out["cuda_holder_error"] = repr(e)
    for name, fn in [
        ("facts", lambda: collect(root).to_json()),
        ("validate", lambda: load.validate(kernel, *_loaded(root)).__dict__),
        ("holders", lambda: json.loads(json.dumps(holders.find_holders(kernel), default=lambda o: o.__dict__))),
        ("mig_record", lambda: mig.record(kernel)),
        ("dry_run_commands", lambda: [list(r.argv) for r in runner.history if r.dry_run]),
    ]:
        try:
            out[name] = fn()
        except Exception:
            out[name] = {"exception": traceback.format_exc()}
    if holder_proc is not None:
        out["cuda_holder_pid"] = holder_proc.pid
        holder_proc.kill()
    json.dump(out, sys.stdout, indent=1, default=str)
    return 0


def _loaded(root):
    from driverd.driver.ident import parse_version_file as parse_nvidia_version
    v, f, _ = parse_nvidia_version(root.read_text("/proc/driver/nvidia/version"))
    return v, f


if __name__ == "__main__":
    time.sleep(0)
    raise SystemExit(main())
