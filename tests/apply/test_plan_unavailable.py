"""Issue 48: `plan --driver` of a version no repository has exited 0 and `apply --dry-run` said it would run.
Where every repository is local (file://, read without the network) the plan reads their indexes when it
would fetch, and is BLOCKED naming the package and what each index lists; nothing is written."""
from __future__ import annotations

from tests.apply.conftest import drv, tree_files


def _config(root, repo, version: str) -> None:
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[driver]\nversion = "{version}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                   'build_fallback = false\n[runtime]\nrestart = "none"\n')


def test_a_version_no_local_repository_lists_is_blocked_before_anything_runs(host, packages):
    _config(host, packages["old"].parent, "999.12.34")
    before = tree_files(host)
    r = drv(host, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "nothing can provide the 999.12.34 (open) package" in r.stdout, r.stdout
    assert "no repository lists driverd-999.12.34-open-" in r.stdout and "packages, not this one" in r.stdout
    r = drv(host, "apply", "--dry-run")
    assert r.returncode == 3 and "would run" not in r.stdout, r.stdout + r.stderr
    assert tree_files(host) == before                      # nothing written: no journal, no serial recorded


def test_a_version_the_local_repository_lists_plans_as_before(host, packages):
    _config(host, packages["new"].parent, "550.127.05")
    r = drv(host, "plan")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fetch-package" in r.stdout and "BLOCKED" not in r.stdout


def test_status_after_a_reload_killed_at_its_first_step_is_not_in_sync(host, packages):
    """Issue 48: after a kill -9 at a reload's first step `status` said "in sync" while the next apply
    finished the reload (an upgrade) and then went back (a downgrade). Status now says the run is unfinished
    and that the next command finishes it first."""
    import json
    from tests.apply.conftest import journal
    _config(host, packages["old"].parent, "535.261.03")
    assert drv(host, "load").returncode == 0
    r = drv(host, "reload", "--package", str(packages["new"]), faults={"FAULTS_KILL_AFTER": 8, "FAULTS_UNDER": host})
    assert r.returncode < 0, r.stdout + r.stderr                       # killed
    assert journal(host)["state"] == "running"
    r = drv(host, "status", "--json")
    assert r.returncode == 0, r.stderr
    w = json.loads(r.stdout)["wanted"]
    assert w["in_sync"] is False and w["verdict"] == "unfinished", w
    assert "the reload run" in w["differs"][0] and "the next driverd command finishes it first" in w["differs"][0]
    text = drv(host, "status").stdout
    assert "DIFFERS: the reload run" in text and "in sync" not in text, text
