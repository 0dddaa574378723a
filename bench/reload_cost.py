#!/usr/bin/env python3
"""What `driverd reload` of the driver in use costs on a real kernel, against the bare
`modprobe -r nvidia_drm nvidia_modeset nvidia_uvm nvidia` + `modprobe` of the same modules with the same
parameters measured in the same guest, in the same boot (issue 34: target ≤ 1.5×).

Boots Debian's 6.1.0-47-amd64 under QEMU (TCG) with virtme-ng, as tests/vm does (tests/vm/harness: the
stand-in modules built by `driverd build` against the real headers, signed, fetched from a file://
repository), applies 535 with three parameters, then runs the guest's `reload_cost` scenario: one untimed
run of each, then RUNS of each alternately, wall clock in the guest. driverd runs from cached bytecode, as
an installed driverd does. Prints every run, the medians and their ratio, each journal phase's median,
what lies outside the journal's run (start-up, planning, the outcome), and with --profile the functions a
reload spends its time in (one more run under cProfile).

Every number is TCG's: an emulated CPU slows the Python work and the kernel's work alike, not equally;
the ratio is the comparable number, the seconds are not a real host's.

Usage: python3 bench/reload_cost.py [--runs 5] [--profile] [--work-dir DIR] [--json FILE]
Exit: 0 within the target, 1 above it, 2 the measurement did not complete.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TARGET = 1.5


def prepare(base: Path) -> dict:
    """The 535 stand-in package (signed by a test key) in a file:// repository, and the runtime image."""
    from driverd.sim import fakemod
    from tests.vm import harness as h
    t0 = time.monotonic()
    signer = fakemod.test_signer(base / "key", str(h.HEADERS))
    repo = base / "repo"
    old = h.build_package(base, h.OLD, repo, signer=signer)
    r = h.driverd_cli("repo", "index", str(repo), "--json")
    if r.returncode != 0:
        raise SystemExit(f"driverd repo index failed: {r.stderr[-2000:]}")
    t1 = time.monotonic()
    image = h.runtime_image(base)
    return {"repo": repo, "old": old, "image": image, "package_s": t1 - t0, "image_s": time.monotonic() - t1}


def med(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def report(res: dict) -> dict:
    drv = [d["seconds"] for d in res["driverd"]]
    bare = [b["seconds"] for b in res["bare"]]
    inside = [d["run_seconds"] for d in res["driverd"]]
    ratio = med(drv) / med(bare)
    phases: dict[str, list[float]] = {}
    for d in res["driverd"]:
        for s in d["steps"]:
            phases.setdefault(s["action"], []).append(s["seconds"])
    return {"driverd_s": drv, "bare_s": bare, "run_s": inside, "driverd_median": med(drv), "bare_median": med(bare),
            "ratio": ratio, "target": TARGET, "within": ratio <= TARGET, "ratio_fastest": min(drv) / min(bare),
            "phases_median": {a: med(v) for a, v in phases.items()},
            "outside_run_median": med(d - i for d, i in zip(drv, inside) if i is not None),
            "python_start_median": med(res["python_start"]), "driverd_start_median": med(res["driverd_start"]),
            "warmup": {"driverd": res["warmup"]["driverd"]["seconds"], "bare": res["warmup"]["bare"]["seconds"]}}


def print_report(rep: dict, res: dict) -> None:
    print(f"modules {', '.join(res['modules'])}; parameters {res['parameters']}")
    print(f"bare: {res['bare_command']}")
    print(f"untimed first runs: driverd {rep['warmup']['driverd']:.2f}s (fills the bytecode cache), "
          f"bare {rep['warmup']['bare']:.2f}s")
    print("run   driverd reload   its journal run   bare modprobe")
    for i, (d, b) in enumerate(zip(res["driverd"], res["bare"]), 1):
        print(f"{i:>3}   {d['seconds']:>12.2f}s   {d['run_seconds'] or float('nan'):>14.2f}s   {b['seconds']:>12.2f}s")
    print(f"median driverd reload {rep['driverd_median']:.2f}s, bare {rep['bare_median']:.2f}s: "
          f"ratio {rep['ratio']:.2f}x (target <= {TARGET}x: {'met' if rep['within'] else 'NOT met'})")
    print(f"fastest of each: driverd {min(rep['driverd_s']):.2f}s, bare {min(rep['bare_s']):.2f}s: ratio "
          f"{rep['ratio_fastest']:.2f}x (the runs least disturbed by other work on this machine)")
    print("journal phases (median): " + ", ".join(f"{a} {s:.2f}s" for a, s in rep["phases_median"].items()))
    print(f"outside the journal's run (start-up, planning, outcome): median {rep['outside_run_median']:.2f}s; "
          f"python -c pass {rep['python_start_median']:.2f}s, `driverd reload --help` (imports, parser) "
          f"{rep['driverd_start_median']:.2f}s")


def print_profile(path: Path, top: int = 30) -> None:
    import io
    import pstats
    buf = io.StringIO()
    pstats.Stats(str(path), stream=buf).sort_stats("cumulative").print_stats(top)
    print("\none reload under cProfile (cumulative; the profiler's own cost inflates it):")
    print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:12000])


def main() -> int:
    from tests.vm import harness as h
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each (default 5)")
    ap.add_argument("--profile", action="store_true", help="one more reload under cProfile, its top functions")
    ap.add_argument("--work-dir", type=Path, help="where packages, images and the guest's results go "
                    "(default: a new temporary directory)")
    ap.add_argument("--json", type=Path, help="write every run and the medians to FILE")
    ap.add_argument("--icount", type=int, metavar="SHIFT", help="run the guest's clock by its instructions "
                    "(QEMU -icount shift=SHIFT, 2**SHIFT ns each; one vCPU): times in virtual seconds that other "
                    "work on this machine does not disturb; 3 is ~125 MIPS")
    a = ap.parse_args()
    missing = h.missing_components()
    if missing:
        print(f"VM engine missing: {', '.join(missing)} (bash .ci/install-components installs it)")
        return 2
    base = a.work_dir or Path(tempfile.mkdtemp(prefix="driverd-reload-cost-"))
    base.mkdir(parents=True, exist_ok=True)
    p = prepare(base)
    spec = {"scenarios": ["setup", "nouveau_then_apply", "reload_cost"], "repo": str(p["repo"]),
            "packages": {"535": str(p["old"])}, "versions": {"535": h.OLD, "550": h.NEW},
            "reload_runs": a.runs, "reload_profile": a.profile}
    b = h.boot(spec, base / "out", h.image_copy(p["image"], base / "boot.img"), timeout=600 + 120 * a.runs,
               icount=a.icount)
    if a.icount is not None:
        print(f"guest clock: QEMU -icount shift={a.icount} (one vCPU): every time below is virtual, "
              f"{2 ** a.icount} ns an instruction")
    print(f"package {p['package_s']:.0f}s, runtime image {p['image_s']:.0f}s, boot+run {b.seconds:.0f}s "
          f"(kernel up to the first scenario {b.boot_seconds}s); work dir {base}")
    res = b.results.get("reload_cost")
    bad = [n for n in spec["scenarios"] if "error" in b.results.get(n, {"error": "did not run"})]
    if res is None or bad:
        print(f"the guest did not finish {bad} (rc {b.rc}): " + "; ".join(
            str(b.results.get(n, {}).get("error", "did not run"))[-1500:] for n in bad))
        print(b.console[-3000:])
        return 2
    apply = b.results["nouveau_then_apply"]["apply"]
    failed = [d for d in [res["warmup"]["driverd"]] + res["driverd"] if d["rc"] != 0 or d["held"] != res["held_before"]] \
        + [x for x in [res["warmup"]["bare"]] + res["bare"] if x["rc"] != 0 or x["held"] != res["held_before"]]
    if apply["rc"] != 0 or failed:
        print(f"apply rc {apply['rc']} {apply['stderr'][-1500:]}; runs that failed or changed the modules: {failed}")
        return 2
    rep = report(res)
    print_report(rep, res)
    print("\n`driverd status` after the last run:\n" + "\n".join(
        ln for ln in res["status_text"].splitlines() if ln.startswith(("last run", "  steps:", "  rollback:"))))
    if a.profile and (res.get("profile") or {}).get("rc") == 0:
        print_profile(Path(res["profile"]["path"]))
    if a.json:
        a.json.write_text(json.dumps({"report": rep, "guest": res}, indent=1, default=str))
    return 0 if rep["within"] else 1


if __name__ == "__main__":
    sys.exit(main())
