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


def test_a_reboot_of_an_nvswitch_host_starts_its_fabric_manager_from_the_installed_companion_offline(
        packages, tmp_path, daemons):
    """Issue 46's companion is part of what comes back from disk (issue 43): an HGX host whose fabric manager
    came as driverd's companion of its driver reboots while the repository refuses connections; the daemon
    loads the driver and starts the fabric manager of its version from the installed companion tree, the fabric
    completes, READY=1 — nothing fetched."""
    from driverd.install.modules import install
    from driverd.repo.index import write_index
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_companion_packages, make_host
    from tests.packages import usfake
    usfake.require_ldconfig()
    node = make_host(tmp_path / "hgx", dgx_spec(gpus=2, nvswitches=1, nouveau=False))
    (node / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (node / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    install(Root(node), packages["old"], Runner())
    ref, repo = _repository(node, packages, tmp_path, "repository")
    make_companion_packages(repo, versions=(OLD,))
    write_index(repo, verify=False)
    with RepoServer(repo) as srv:
        _configure(node, srv.url, "repository")
        cfg = node / "etc/driverd/config.toml"
        cfg.write_text(cfg.read_text() + "[companions]\nfetch = true\n")
        r = drv(node, "apply")
        assert r.returncode == 0, r.stdout + r.stderr
        asked = [p for p, _, _ in srv.faults.requests]
    assert any("companion-fabricmanager" in p for p in asked), asked
    fm_tree = node / "var/lib/driverd/driver/companions/fabricmanager/current"
    assert fm_tree.is_symlink()
    runs = len(journal_runs(node))

    reboot(node)
    (node / "run/driverd-sim/fabric-state").unlink(missing_ok=True)     # the fabric is unconfigured after a boot
    plan = json.loads(drv(node, "plan", "--json").stdout)
    assert not plan["blocked_by"], plan
    assert not any(s["action"].startswith("fetch-") or (s["action"] == "install-companion" and
                                                        not s["params"].get("installed", True))
                   for s in plan["steps"]), plan["steps"]
    assert "start-fabricmanager" in [s["action"] for s in plan["steps"]], plan["steps"]
    d = daemons(node)
    _, ready = d.wait_notify("READY=1", 90)
    assert "workload-ready" in ready, d.log
    assert (node / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    fm = [p for p in (node / "proc").iterdir() if p.name.isdigit() and (p / "cmdline").is_file()
          and "nv-fabricmanager" in (p / "cmdline").read_text()]
    assert fm and "companions/fabricmanager" in (fm[0] / "cmdline").read_text(), [
        (p / "cmdline").read_text() for p in fm]
    steps = [s["action"] for run in journal_runs(node)[runs:] for s in run["steps"]]
    assert not any(a.startswith("fetch-") for a in steps), steps
    assert d.stop()[0] == 0
