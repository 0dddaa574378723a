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
    # the plan's configure-runtime step went through driverd.runtime: handler added, CDI spec written
    d = json.loads(run_cli("detect", "--root", str(tmp_path / "demo/host"), "--json", "--no-nvml").stdout)
    [ctd] = [x for x in d["runtimes"] if x["name"] == "containerd"]
    assert ctd["handlers"] == ["runc", "nvidia"]
    spec = (tmp_path / "demo/host/var/run/cdi/nvidia.yaml").read_text()
    assert "nvidia.com/gpu" in spec and "name: all" in spec


def test_runtime_change_is_undone_when_a_later_step_fails(tmp_path):
    """configure-runtime has an undo: when a step after it fails, containerd's config is restored."""
    from driverd import config as config_mod
    from driverd.errors import DriverdError
    from driverd.kmod.commands import executor, make_context
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "host"
    make_host(root, dgx_spec())
    before = (root / "etc/containerd/config.toml").read_bytes()
    cfg = config_mod.load(Root(root), environ={}).with_overrides({"runtime.restart": "none"})
    ctx = make_context(Root(root), Runner(), cfg)
    steps = [{"action": "configure-runtime", "params": {"runtime": "containerd", "handler": "nvidia"}},
             {"action": "validate", "params": {"expect": ["999.1.1", "open"]}}]   # nothing is loaded: fails
    try:
        doc = executor(ctx).run("apply", steps)
    except DriverdError:
        doc = None
    assert (root / "etc/containerd/config.toml").read_bytes() == before
    journal = (root / "var/lib/driverd/journal.json").read_text()
    assert '"files_changed": [' in journal and "config.toml" in journal     # configure-runtime did write
    assert '"revert-runtime"' in journal                                     # and its undo ran
