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
