"""Two mutating commands started together on one host: one runs, the other exits 3 naming it (or,
with --wait, runs after it); the journal history holds every run that ran, and `driverd status`
agrees with the last journal every time."""
from __future__ import annotations

import json

import pytest

from tests.apply.conftest import history, journal, start, status

TRIALS = 20


def _pair(root, a: tuple, b: tuple) -> list[tuple[tuple, int, str, str]]:
    procs = [(args, start(root, *args, "--root", str(root))) for args in (a, b)]
    out = []
    for args, p in procs:
        so, se = p.communicate(timeout=300)
        out.append((args, p.returncode, so, se))
    return out


def _check(root, results, runs_before: set[str]) -> None:
    ran = [r for r in results if r[1] in (0, 3) and "holds the host lock" not in r[3]]
    lost = [r for r in results if "holds the host lock" in r[3]]
    assert ran, results
    for args, rc, _so, se in lost:
        assert rc == 3, (args, rc, se)
        line = se.strip().splitlines()[-1]
        others = [" ".join(o[0][:2]) for o in results if o[0] != args]
        assert "pid " in line and any(o.split()[0] in line for o in others), line
    j = journal(root)
    runs = {h["run_id"] for h in history(root)} | {j["run_id"]}
    new_runs = runs - runs_before
    ran_something = [r for r in ran if "nothing to do" not in r[2]]
    assert len(new_runs) == len(ran_something), (new_runs, [r[0] for r in ran_something])
    st = status(root)
    assert st["last_run"]["run_id"] == j["run_id"] and st["last_run"]["state"] == j["state"]
    assert not st["last_run"]["unfinished"] and st["lock_holder"] is None
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["reload+rollback", "apply+install", "runtime-configure+revert"])
def test_two_mutating_commands_started_together(loaded_host, packages, pair):
    root = loaded_host
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n[runtime]\nrestart = "none"\n'
                   f'[packages]\nrepositories = ["file://{packages["old"].parent}"]\n')
    if pair == "reload+rollback":
        assert start(root, "install", str(packages["new"]), "--root", str(root)).wait() == 0
        a, b = ("reload", "--package", str(packages["new"])), ("rollback",)
    elif pair == "apply+install":
        a, b = ("apply",), ("install", str(packages["new"]))
    else:
        a, b = ("runtime", "configure", "--runtime", "containerd"), ("runtime", "revert")
    runs = {h["run_id"] for h in history(root)} | ({journal(root)["run_id"]} if journal(root) else set())
    outcomes = {"one ran, the other was refused": 0, "both ran, one after the other": 0}
    for i in range(TRIALS):
        results = _pair(root, a, b) if i % 2 == 0 else _pair(root, b, a)
        runs = _check(root, results, runs)
        refused = any("holds the host lock" in r[3] for r in results)
        outcomes["one ran, the other was refused" if refused else "both ran, one after the other"] += 1
    # --wait: the second one waits for the first instead of failing.
    procs = [start(root, *a, "--wait", "120", "--root", str(root)), start(root, *b, "--wait", "120", "--root", str(root))]
    for p in procs:
        so, se = p.communicate(timeout=300)
        assert p.returncode in (0, 3) and "holds the host lock" not in se, se
    print(f"\nconcurrency {pair}: {TRIALS} trials: {json.dumps(outcomes)}; with --wait both ran")
