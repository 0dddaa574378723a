#!/usr/bin/env python3
"""A longer fuzz run of driverd's parsers of untrusted input (issue 21): every target of
tests/fuzz/targets.py (module signature trailer + PKCS#7, index.json, manifest, package archive,
containerd/CRI-O TOML, Docker JSON, /proc/keys, /proc/modules, modinfo output, kmsg NVRM lines, the
DriverRollout spec) for --seconds each, with fresh random seeds in rounds of --batch examples.
Prints executions, executions per second and findings (the contract: return, or raise driverd's own
error type on one line; anything else is a finding, shown with hypothesis' shrunk example).
Usage: python3 bench/fuzz.py [--seconds 30] [--batch 500] [--only NAME,...]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402

from tests.fuzz.targets import TARGETS  # noqa: E402


def run_target(t, seconds: float, batch: int) -> tuple[int, float, list[str]]:
    count = {"n": 0}
    findings: list[str] = []
    strategy = t.strategy()

    def body(data):
        count["n"] += 1
        t.run(data)

    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        @seed(random.getrandbits(64))
        @settings(max_examples=batch, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(strategy)
        def fuzz(data):
            body(data)
        try:
            fuzz()
        except Exception as e:                      # a finding: keep its first lines, go on with new seeds
            first = " ".join(str(e).split())[:300]
            if first not in findings:
                findings.append(f"{type(e).__name__}: {first}")
    return count["n"], time.monotonic() - t0, findings


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    names = set(filter(None, a.only.split(",")))
    total, bad = 0, 0
    print(f"{'target':22} {'executions':>10} {'exec/s':>8}  findings")
    for t in TARGETS:
        if names and t.name not in names:
            continue
        n, secs, findings = run_target(t, a.seconds, a.batch)
        total += n
        bad += len(findings)
        print(f"{t.name:22} {n:>10} {n / secs:>8.0f}  {len(findings)}", flush=True)
        for f in findings:
            print(f"    {f}")
    print(f"total: {total} executions, {bad} findings")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
