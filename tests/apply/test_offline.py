"""Issue 43: nothing reaches the network for what is already on disk. The air-gapped path of the README — `driverd
fetch --repo file:///media/...` puts the verified package in the cache, and with no packages.repositories
configured `driverd plan` is not blocked and `driverd apply` installs it from the cache; a cached kernel or
user-space package serves when the repository refuses connections; and switching back to a user-space version
whose tree is installed fetches nothing."""
from __future__ import annotations

import json
import os
import shutil


from driverd.root import Root
from driverd.sim.httprepo import RepoServer
from tests.apply.conftest import drv, journal, kernel_of
from tests.apply.test_userspace_txn import in_use, us_package
from tests.conftest import run_cli

OLD, NEW = "535.261.03", "550.127.05"


def _config(root, version: str, *, repos: list[str] = (), extra: str = "") -> None:
    p = root / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(f'[driver]\nversion = "{version}"\nflavor = "open"\n[packages]\nrepositories = {json.dumps(list(repos))}\n'
                 f'insecure = true\n[runtime]\nrestart = "none"\n{extra}')


def _cached(root) -> list[str]:
    d = root / "var/cache/driverd/packages"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_air_gapped_fetch_from_a_medium_then_plan_and_apply_with_no_repository_configured(host, packages, tmp_path):
    usb = tmp_path / "usb"
    usb.mkdir()
    shutil.copy(packages["new"], usb)
    run_cli("repo", "index", str(usb), check=True)
    _config(host, NEW)                                  # no repository; no source to build from
    r = drv(host, "fetch", "--driver", NEW, "--repo", f"file://{usb}", "--json")
    assert r.returncode == 0, r.stderr
    assert _cached(host) == [os.path.basename(packages["new"])]
    shutil.rmtree(usb)                                  # the medium is unplugged

    r = drv(host, "plan", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["verdict"] != "blocked", r.stdout + r.stderr
    assert not doc["blocked_by"], doc["blocked_by"]
    assert "fetch-package" in [s["action"] for s in doc["steps"]]

    r = drv(host, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    got = next(s for s in journal(host)["steps"] if s["action"] == "fetch-package")["result"]
    assert os.path.basename(got["package"]) == os.path.basename(packages["new"]), got
    assert kernel_of(host).modules()["nvidia"].version == NEW


def test_with_nothing_cached_the_air_gapped_plan_is_still_blocked_naming_the_fix(host, packages):
    _config(host, NEW)
    r = drv(host, "plan", "--json")
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "blocked" and "nothing can provide the 550.127.05 (open) package" in doc["blocked_by"][0]


def test_a_damaged_cache_entry_is_not_used_and_is_removed(host, packages, tmp_path):
    usb = tmp_path / "usb"
    usb.mkdir()
    shutil.copy(packages["new"], usb)
    run_cli("repo", "index", str(usb), check=True)
    _config(host, NEW)
    assert drv(host, "fetch", "--driver", NEW, "--repo", f"file://{usb}").returncode == 0
    cached = host / "var/cache/driverd/packages" / os.path.basename(packages["new"])
    with open(cached, "r+b") as f:
        f.seek(200)
        f.write(b"\0" * 32)
    r = drv(host, "apply")
    assert r.returncode != 0 and "no package" in r.stderr, r.stdout + r.stderr
    assert not cached.exists()
    assert "nvidia" not in kernel_of(host).modules() or kernel_of(host).modules()["nvidia"].version != NEW


def test_a_cached_kernel_package_serves_when_the_repository_refuses_connections(host, packages, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(packages["new"], repo)
    run_cli("repo", "index", str(repo), check=True)
    with RepoServer(repo) as srv:
        _config(host, NEW, repos=[srv.url])
        assert drv(host, "fetch", "--no-build").returncode == 0
    # the server is closed: its port refuses connections
    r = drv(host, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    got = next(s for s in journal(host)["steps"] if s["action"] == "fetch-package")["result"]
    assert os.path.basename(got["package"]) == os.path.basename(packages["new"])
    assert kernel_of(host).modules()["nvidia"].version == NEW


def test_a_cached_userspace_package_serves_when_the_repository_refuses_connections(node, packages, tmp_path):
    from driverd.config import load
    from driverd.repo.userspace import fetch
    repo = tmp_path / "repo"
    repo.mkdir()
    ref = us_package(node, OLD)
    shutil.move(ref.path, repo / os.path.basename(ref.path))
    run_cli("repo", "index", str(repo), check=True)
    root = Root(node)
    with RepoServer(repo) as srv:
        _config(node, OLD, repos=[srv.url], extra="[userspace]\nfetch = true\n")
        cfg = load(root, None, {})
        first = fetch(root, cfg, OLD, "x86_64")
    assert first.sha256 == ref.sha256
    again = fetch(root, cfg, OLD, "x86_64")
    assert (again.package, again.sha256, again.source) == (first.package, ref.sha256, "cache")


def test_going_back_to_a_version_driverd_kept_fetches_nothing(node, packages, tmp_path):
    """535 -> 550 with userspace.fetch, then driver.version back to 535 while the repository refuses
    connections and nothing is cached: the 535 kernel package comes back from the kept store and the 535
    user-space tree driverd kept is switched to with it; nothing is fetched."""
    repo = tmp_path / "repo"
    repo.mkdir()
    refs = {}
    for v, pkg in ((OLD, packages["old"]), (NEW, packages["new"])):
        shutil.copy(pkg, repo)
        refs[v] = us_package(node, v)
        shutil.move(refs[v].path, repo / os.path.basename(refs[v].path))
    run_cli("repo", "index", str(repo), check=True)
    with RepoServer(repo) as srv:
        for v in (OLD, NEW):
            _config(node, v, repos=[srv.url], extra="[userspace]\nfetch = true\n")
            r = drv(node, "apply")
            assert r.returncode == 0, r.stdout + r.stderr
            assert in_use(node) == refs[v].sha256
        url = srv.url
    shutil.rmtree(node / "var/cache/driverd")           # nothing cached: only what is installed and kept
    _config(node, OLD, repos=[url], extra="[userspace]\nfetch = true\n")
    r = drv(node, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    acts = [s["action"] for s in journal(node)["steps"]]
    assert not any(a.startswith("fetch-") for a in acts), acts
    assert "restore-package" in acts and "install-userspace" in acts, acts
    assert (kernel_of(node).modules()["nvidia"].version, in_use(node)) == (OLD, refs[OLD].sha256)
