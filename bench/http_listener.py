#!/usr/bin/env python3
"""The daemon's HTTP listener under a bounded socket storm (issue 21), loopback only, < 60 s.

For each implementation — `driverd` (daemon/endpoints.py) and `baseline` (the standard library's
ThreadingHTTPServer, as driverd served before) — in its own child process with `ulimit -n 1024`:
/healthz latency quiet (p50/p99), then again while IDLE idle sockets, SLOW slowloris trickles, BIG
clients sending 99 x 64 KB header lines and RESETS reset-before-read clients are at it; the
listener's RSS, threads and descriptors before and at the peak; failed probes. Prints one line per
implementation and the ratios storm/quiet p99 and driverd/baseline.
Usage: python3 bench/http_listener.py [--idle 1500] [--slow 100] [--big 40] [--resets 500] [--probes 200]
"""
from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.daemon import listener_load as load  # noqa: E402


def run(impl: str, a) -> dict:
    c = load.start(impl, head_timeout_s=5.0)
    try:
        for _ in range(20):
            load.get(c.port)
        quiet = load.probe(c.port, a.probes, pause_s=0.0)
        before = c.status()
        storm = load.Storm(c.port, idle=a.idle, slowloris=a.slow, big=a.big, resets=a.resets).start()
        t_end = time.monotonic() + 20
        try:
            during = []
            for _ in range(a.probes):
                if time.monotonic() > t_end:
                    break
                code, _, dt = load.get(c.port, timeout=2.0)
                during.append((code, dt))
                time.sleep(0.02)
            peak = c.status()
        finally:
            storm.stop()
        time.sleep(0.5)
        after = c.status()
    finally:
        err = c.stop()
    ok = [t for code, t in during if code == 200]
    return {"impl": impl, "quiet_p50_ms": statistics.median(t for _, t in quiet) * 1e3,
            "quiet_p99_ms": load.p99([t for _, t in quiet]) * 1e3,
            "storm_p99_ms": load.p99(ok) * 1e3 if ok else float("inf"),
            "failed": len(during) - len(ok), "probes": len(during),
            "rss_before_mb": before["VmRSS"] / 1024, "rss_peak_mb": peak["VmRSS"] / 1024,
            "rss_after_mb": after["VmRSS"] / 1024, "threads_peak": peak["Threads"], "fds_peak": peak["fds"],
            "traceback_lines": err.count("Traceback")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--idle", type=int, default=1500)
    ap.add_argument("--slow", type=int, default=100)
    ap.add_argument("--big", type=int, default=40)
    ap.add_argument("--resets", type=int, default=500)
    ap.add_argument("--probes", type=int, default=200)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    rows = [run("driverd", a), run("baseline", a)]
    for r in rows:
        print(f"{r['impl']:8}  quiet p50 {r['quiet_p50_ms']:.2f} ms p99 {r['quiet_p99_ms']:.2f} ms | storm p99 "
              f"{r['storm_p99_ms']:.2f} ms, {r['failed']}/{r['probes']} probes failed | RSS {r['rss_before_mb']:.1f}"
              f" -> peak {r['rss_peak_mb']:.1f} -> after {r['rss_after_mb']:.1f} MB | threads {r['threads_peak']}, "
              f"fds {r['fds_peak']} | tracebacks {r['traceback_lines']}")
    d, b = rows
    print(f"driverd storm/quiet p99 ratio {d['storm_p99_ms'] / d['quiet_p99_ms']:.2f}; "
          f"RSS growth driverd {d['rss_peak_mb'] - d['rss_before_mb']:.1f} MB vs baseline "
          f"{b['rss_peak_mb'] - b['rss_before_mb']:.1f} MB; failed probes driverd {d['failed']} vs baseline "
          f"{b['failed']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
