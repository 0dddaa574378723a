from tests.conftest import run_cli


def test_demo_runs_end_to_end(tmp_path):
    r = run_cli("demo", "--workdir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "apply: done" in out and "reload: rolled-back" in out and "RmFetchGspRmImages" in out
    assert r.stdout.rstrip().splitlines()[-1].startswith("== done in")
    st = run_cli("status", "--root", str(tmp_path / "demo/host"), "--json")
    import json
    s = json.loads(st.stdout)
    assert s["loaded"] == {"version": "535.261.03", "flavor": "open"} and s["last_run"]["state"] == "rolled-back"
