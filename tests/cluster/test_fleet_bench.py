"""bench/fleet.py's faults end in defined, reported states, and the observer's limits hold."""
from __future__ import annotations

import argparse
import importlib.util

import pytest

from tests.conftest import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("fleet_bench", REPO / "bench/fleet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_every_fault_ends_defined_with_nothing_left_cordoned(tmp_path):
    bench = _bench()
    a = argparse.Namespace(nodes=10, max_parallel=3, max_unavailable="30%", seed=7, drain_timeout=2, timeout=300,
                           workdir=str(tmp_path), json=True,
                           faults="apiserver-restart,daemon-kill,pdb-never,node-notready,reload-fails")
    r = bench.run(a)
    assert r["completed"], r
    assert r["max_unavailable_seen"] <= r["limit_unavailable"] == 3
    assert r["left_cordoned_by_us"] == 0
    out = r["fault_outcomes"]
    assert out["pdb-never"]["state"] == "failed" and "EvictionBlocked" in out["pdb-never"]["reason"]
    assert out["reload-fails"]["state"] == "failed" and "RolledBack" in out["reload-fails"]["reason"]
    for f in ("apiserver-restart", "daemon-kill", "node-notready"):
        assert out[f]["state"] == "done", (f, out[f])
    assert r["final_states"] == {"done": 8, "failed": 2}
    assert r["api_requests_per_node"] <= 40
