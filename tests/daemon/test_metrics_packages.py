"""Package metrics of a running daemon, scraped from /metrics: fetch durations by source (a cache hit,
or a miss a repository or a local build served), cache hits and misses, failures by reason, local
build durations and failures - recorded where fetch and build happen (driverd.observe), wired to
Prometheus by the daemon only: a one-shot command never imports prometheus_client."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile

from driverd.sim.scenario import RELEASE
from tests.daemon.conftest import NEW, OLD, write_config
from tests.conftest import driverd_env


THIRD = "545.29.06"


def _count(d, name: str, **labels) -> float:
    return d.metric(name, **labels) or 0.0


def test_fetch_and_build_metrics_of_a_running_daemon(host, packages, daemons, tmp_path):
    from driverd.sim.fakepkg import make_fake_package
    from tests.conftest import run_cli
    # the session's packages and a third version nothing has installed (going back to OLD later would come
    # from driverd's kept store, not the cache: no fetch at all)
    repo = tmp_path / "repo"
    repo.mkdir()
    for k in ("old", "new"):
        shutil.copy(packages[k], repo)
    third = make_fake_package(repo, THIRD, RELEASE).path
    run_cli("repo", "index", str(repo), check=True)
    write_config(host, OLD, repo)
    d = daemons(host)
    d.wait_notify("READY=1", 60)             # OLD is installed already: converged without a fetch
    assert d.metric("driverd_package_cache_hits_total") == 0
    assert d.metric("driverd_package_cache_misses_total") == 0

    n = len(d.lines)
    write_config(host, NEW, repo)            # NEW is fetched from the file:// repository: a miss
    d.wait_log(r"converged: driver 550\.127\.05", 60, start=n)
    assert _count(d, "driverd_package_fetch_duration_seconds_count", source="repository", result="ok") == 1
    assert d.metric("driverd_package_cache_misses_total") == 1
    assert d.metric("driverd_package_cache_hits_total") == 0
    assert _count(d, "driverd_package_fetch_duration_seconds_sum", source="repository", result="ok") > 0

    cache = host / "var/cache/driverd/packages"
    shutil.copy(third, cache / third.name)                          # THIRD is in the cache now: a hit
    n = len(d.lines)
    write_config(host, THIRD, repo)
    d.wait_log(r"converged: driver 545\.29\.06", 60, start=n)
    assert _count(d, "driverd_package_fetch_duration_seconds_count", source="cache", result="ok") == 1
    assert d.metric("driverd_package_cache_hits_total") == 1
    assert d.metric("driverd_package_cache_misses_total") == 1

    # a version a local (file://) repository does not list is blocked by the plan, before any fetch (issue 48)
    n = len(d.lines)
    write_config(host, "560.35.03", repo)
    d.wait_log(r"not converged: blocked: .*no repository lists driverd-560\.35\.03", 60, start=n)
    assert not _count(d, "driverd_package_fetch_failures_total", reason="not-found")
    # over HTTP the plan does not ask: the fetch does, and fails, counted (no source to build it from)
    from driverd.sim.httprepo import RepoServer
    srv = RepoServer(repo).__enter__()
    n = len(d.lines)
    write_config(host, "560.35.03", repo)
    text = (host / "etc/driverd/config.toml").read_text().replace(f'"file://{repo}"', f'"{srv.url}"').replace(
        "[packages]\n", "[packages]\ninsecure = true\n")
    (host / "etc/driverd/config.toml.new").write_text(text)
    os.replace(host / "etc/driverd/config.toml.new", host / "etc/driverd/config.toml")
    d.wait_log(r"not converged: failed: .*no package driverd-560\.35\.03", 60, start=n)
    assert _count(d, "driverd_package_fetch_failures_total", reason="not-found") >= 1
    assert _count(d, "driverd_package_fetch_duration_seconds_count", source="none", result="error") >= 1

    # a local build is tried (headers and a source are there) and fails: the source holds no driver
    hdr = host / f"usr/src/linux-headers-{RELEASE}"        # lib/modules/R/build points there
    hdr.mkdir(parents=True, exist_ok=True)
    (hdr / "Makefile").write_text("")
    (hdr / ".config").write_text("CONFIG_X86_64=y\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src/README").write_text("not a driver\n")
    src = host / "usr/src/nvidia-kernel.tar.xz"
    src.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src, "w:xz") as t:
        t.add(tmp_path / "src", arcname="src")
    n = len(d.lines)
    text = (host / "etc/driverd/config.toml").read_text().replace(
        "[packages]\n", '[packages]\nsource = "/usr/src/nvidia-kernel.tar.xz"\n')
    (host / "etc/driverd/config.toml.new").write_text(text)
    os.replace(host / "etc/driverd/config.toml.new", host / "etc/driverd/config.toml")
    d.wait_log(r"not converged: failed: .*holds no NVIDIA kernel-module source", 60, start=n)
    assert _count(d, "driverd_package_build_failures_total", reason="source") >= 1
    assert _count(d, "driverd_package_build_duration_seconds_count", result="failed") >= 1
    assert _count(d, "driverd_package_fetch_failures_total", reason="build") >= 1
    assert _count(d, "driverd_package_fetch_duration_seconds_count", source="build", result="error") >= 1

    _, text = d.get("/metrics")
    for family in ("driverd_package_fetch_duration_seconds", "driverd_package_cache_hits_total",
                   "driverd_package_cache_misses_total", "driverd_package_fetch_failures_total",
                   "driverd_package_build_duration_seconds", "driverd_package_build_failures_total"):
        assert f"# TYPE {family.removesuffix('_total')}" in text, family
    assert d.stop()[0] == 0
    srv.__exit__(None, None, None)


def test_one_shot_commands_never_import_prometheus(host, packages, tmp_path):
    """`driverd fetch` reports to driverd.observe like the daemon does, but nothing subscribes."""
    code = ("import sys, driverd.cli as c\n"
            f"rc = c.main(['fetch', '--root', {str(host)!r}, '--driver', {NEW!r}, '--flavor', 'open', "
            f"'--repo', 'file://{packages['new'].parent}', '--no-build'])\n"
            "assert 'prometheus_client' not in sys.modules, 'prometheus_client imported'\n"
            "sys.exit(rc)\n")
    env = driverd_env()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "driverd-550.127.05" in r.stdout


def test_observe_events_from_fetch_and_build(host, packages, tmp_path):
    from driverd import observe
    from driverd.errors import PackageError
    from driverd.build.modules import build
    from driverd.repo.fetch import Want, fetch
    from driverd.root import Root
    seen: list[tuple[str, dict]] = []
    stop = observe.subscribe(lambda e, f: seen.append((e, f)))
    try:
        want = Want(NEW, "open", RELEASE, "x86_64")
        fetch(Root(host), want, [f"file://{packages['new'].parent}"])
        fetch(Root(host), want, [f"file://{packages['new'].parent}"])
        try:
            fetch(Root(host), Want("560.35.03", "open", RELEASE, "x86_64"), [f"file://{packages['new'].parent}"])
        except PackageError:
            pass
        try:
            build(source=str(tmp_path / "missing.tar.xz"), kernel=RELEASE, flavor="open", out=tmp_path / "o",
                  work_dir=tmp_path / "w", root=Root(host))
        except PackageError:
            pass
    finally:
        stop()
    fetches = [f for e, f in seen if e == "package.fetch"]
    assert [(f["source"], f["cache"], f["result"]) for f in fetches] == [
        ("repository", "miss", "ok"), ("cache", "hit", "ok"), ("none", "miss", "error")]
    assert fetches[2]["reason"] == "not-found" and all(f["seconds"] >= 0 for f in fetches)
    builds = [f for e, f in seen if e == "package.build"]
    assert len(builds) == 1 and builds[0]["result"] == "failed" and builds[0]["reason"] == "headers"
    fetch(Root(host), Want(NEW, "open", RELEASE, "x86_64"), [f"file://{packages['new'].parent}"])
    assert len(seen) == 4                     # unsubscribed: nothing more arrives
