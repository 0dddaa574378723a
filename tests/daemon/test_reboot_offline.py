"""Issue 43: after a reboot a node whose driver (modules and user-space) is installed and verified on disk comes
back to ready with no network, whatever `userspace.fetch` says. The simulated host reboots (the simulated kernel
boots without the driver; /run is a tmpfs, so the driver-root link /run/nvidia/driver is gone, and the loader
configuration is removed too) while the package repository refuses connections (its loopback HTTP server is
closed): `driverd daemon` and `driverd container-entrypoint` load the driver, make the link and the loader
configuration again from the installed tree, and send READY=1 — for a user-space installed from
`userspace.package` and from the repository (`userspace.fetch`)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from driverd.sim.httprepo import RepoServer
from tests.apply.conftest import drv, journal
from tests.apply.test_userspace_txn import USDIR, in_use, us_package
from tests.conftest import run_cli
from tests.daemon.conftest import OLD, journal_runs, kernel_of, write_config

LDCONF = "etc/ld.so.conf.d/00-driverd-nvidia.conf"
ON = '[validation]\nworkload = "on"\nworkload_timeout_s = 20\n'


def _repository(node, packages, tmp_path, source: str):
    """A repository directory with the kernel package (and, for source "repository", the user-space package),
    indexed as an operator does; the user-space package stays in the node's USDIR for source "package"."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(packages["old"], repo)
    ref = us_package(node, OLD)
    if source == "repository":
        shutil.move(ref.path, repo / os.path.basename(ref.path))
        shutil.rmtree(node / USDIR.lstrip("/"))
    run_cli("repo", "index", str(repo), "--json", check=True)
    return ref, repo


def _configure(node, url: str, source: str) -> None:
    us = "fetch = true\n" if source == "repository" else f'package = "{USDIR}"\n'
    write_config(node, OLD, "unused", extra=f"[userspace]\n{us}{ON}")
    cfg = node / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace('repositories = ["file://unused"]',
                                           f'repositories = ["{url}"]\ninsecure = true'))


def reboot(node) -> None:
    """The node reboots: the driver is out of the kernel, /run is empty again (the simulated kernel keeps its
    own state there, which its reboot resets), and the loader configuration is gone too."""
    kernel_of(node).reboot()
    for p in (node / "run").iterdir():
        if p.name != "driverd-sim":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    (node / LDCONF).unlink()
    assert "nvidia" not in kernel_of(node).modules()


@pytest.mark.parametrize("mode", ["daemon", "container-entrypoint"])
@pytest.mark.parametrize("source", ["package", "repository"])
def test_a_reboot_with_the_repository_refusing_connections_comes_back_ready(node, packages, tmp_path, daemons,
                                                                            mode, source):
    ref, repo = _repository(node, packages, tmp_path, source)
    with RepoServer(repo) as srv:
        _configure(node, srv.url, source)
        r = drv(node, "apply")
        assert r.returncode == 0, r.stdout + r.stderr
        asked = [p for p, _, _ in srv.faults.requests]
    assert ("/" + os.path.basename(ref.path) in asked) == (source == "repository"), asked
    assert in_use(node) == ref.sha256
    link = os.readlink(node / "run/nvidia/driver")
    runs = len(journal_runs(node))

    reboot(node)                    # the server is closed: its port refuses connections
    plan = json.loads(drv(node, "plan", "--json").stdout)
    acts = [s["action"] for s in plan["steps"]]
    assert not any(a.startswith("fetch-") for a in acts), plan["steps"]
    assert "install-userspace" in acts and "load-modules" in acts, acts
    assert not plan["blocked_by"], plan

    env = {"DRIVERD_ROOT": str(node)} if mode == "container-entrypoint" else None
    d = daemons(node, mode, env=env, root_arg=mode == "daemon")
    _, ready = d.wait_notify("READY=1", 90)
    assert f"STATUS=converged: driver {OLD} (open) loaded and validated, workload-ready" in ready, d.log
    assert d.get("/readyz")[0] == 200
    assert kernel_of(node).modules()["nvidia"].version == OLD
    assert os.readlink(node / "run/nvidia/driver") == link
    assert (node / LDCONF).is_file() and in_use(node) == ref.sha256
    done = journal_runs(node)[runs:]
    steps = [s["action"] for run in done for s in run["steps"]]
    assert not any(a.startswith("fetch-") for a in steps) and "install-userspace" in steps, steps
    assert "cannot reach" not in d.log and "retrying in" not in d.log.split("ready")[0], d.log
    assert d.stop()[0] == 0


def test_a_userspace_package_directory_gone_after_the_reboot_still_comes_back_from_the_installed_tree(
        node, packages, tmp_path, daemons):
    """userspace.package on a share that is not mounted after the reboot (or a download directory cleaned up):
    the installed tree of the version is enough."""
    ref, repo = _repository(node, packages, tmp_path, "package")
    _configure(node, f"file://{repo}", "package")
    assert drv(node, "apply").returncode == 0
    reboot(node)
    shutil.rmtree(node / USDIR.lstrip("/"))
    r = drv(node, "plan")
    assert r.returncode == 0 and "nothing is fetched" in r.stdout, r.stdout + r.stderr
    d = daemons(node)
    d.wait_notify("READY=1", 90)
    assert in_use(node) == ref.sha256 and (node / "run/nvidia/driver").is_symlink()
    assert journal(node)["state"] == "done"
    assert d.stop()[0] == 0
