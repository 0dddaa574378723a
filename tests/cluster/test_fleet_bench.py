"""bench/fleet.py on the real control plane (its own, started by the bench): its faults end in
defined, reported states, the observer's limits hold, requests are counted by kube-apiserver."""
from __future__ import annotations

import argparse
import importlib.util

import pytest

from tests.conftest import REPO


def _bench():
    from tests.controlplane import binaries
    binaries()                      # skips locally / fails in CI without the real control plane
    spec = importlib.util.spec_from_file_location("fleet_bench", REPO / "bench/fleet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ALL = "apiserver-restart,daemon-kill,pdb-never,node-notready,reload-fails,no-controller,two-pdbs,stuck-terminating"


@pytest.mark.slow
def test_every_fault_ends_defined_with_nothing_left_cordoned(tmp_path):
    bench = _bench()
    a = argparse.Namespace(apiserver="real", nodes=12, max_parallel=3, max_unavailable="25%", seed=7, drain_timeout=2, timeout=300,
                           workdir=str(tmp_path), json=True, faults=ALL, failure_budget=None, device_plugin=True)
    r = bench.run(a)
    assert r["completed"] and r["phase"] == "Failed", r
    assert r["admissions_over_limit"] == 0 and r["limit_unavailable"] == 3
    assert r["left_cordoned_by_us"] == 0
    out = r["fault_outcomes"]
    assert out["pdb-never"]["state"] == "failed" and "EvictionBlocked" in out["pdb-never"]["reason"]
    assert out["reload-fails"]["state"] == "failed" and "RolledBack" in out["reload-fails"]["reason"]
    assert out["no-controller"]["state"] == "failed" and "no controller" in out["no-controller"]["reason"]
    assert out["two-pdbs"]["state"] == "failed" and "answered 500" in out["two-pdbs"]["reason"]
    assert out["stuck-terminating"]["state"] == "failed" and "stuck Terminating" in out["stuck-terminating"]["reason"]
    for f in ("apiserver-restart", "daemon-kill", "node-notready"):
        assert out[f]["state"] == "done", (f, out[f])
    assert r["final_states"] == {"done": 7, "failed": 5}
    # the ideal comes from a one-node rollout of the same run, not from the big rollout's own times
    # (both rounded from the same time: one_node_s to 3 places, ideal_s to 2, so they agree to 0.01)
    assert r["one_node_s"] > 0 and abs(r["ideal_s"] - 4 * r["one_node_s"]) <= 0.011
    assert r["apiserver"] == "real" and r["api_requests_per_node"] <= 60 and r["api_requests_per_node_audit"] > 0


@pytest.mark.slow
def test_failures_beyond_the_budget_pause_the_rollout_and_the_bench_says_so(tmp_path):
    bench = _bench()
    a = argparse.Namespace(apiserver="real", nodes=3, max_parallel=1, max_unavailable="1", seed=1, drain_timeout=1, timeout=120,
                           workdir=str(tmp_path), json=True, faults="two-pdbs", failure_budget=0,
                           device_plugin=False)
    r = bench.run(a)
    assert r["phase"] == "Paused" and not r["completed"], r
    assert r["final_states"].get("failed") == 1 and r["left_cordoned_by_us"] == 0
