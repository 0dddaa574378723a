"""`driverd container-entrypoint`: a restart on a host that already is as configured takes the fast
path (ready at once; no journal run, no module unloaded, the GPU daemons untouched), a changed
configuration does not, SIGTERM exits 0 within 10 s, and daemon.unload_on_exit unloads through a
journalled request."""
from __future__ import annotations

import re
import time

from driverd.host import processes
from driverd.root import Root
from tests.apply.conftest import tree_files
from tests.daemon.conftest import OLD, journal_runs, kernel_of, write_config


def _daemon_pids(root) -> dict[str, tuple[int, ...]]:
    return {d.name: d.pids for d in processes.daemons(Root(root))}


def test_a_restart_on_a_converged_host_takes_the_fast_path(host, packages, daemons):
    repo = packages["old"].parent
    write_config(host, OLD, repo)
    env = {"DRIVERD_ROOT": str(host)}                   # as in the image: the root comes from the environment
    d = daemons(host, "container-entrypoint", env=env, root_arg=False)
    d.wait_notify("READY=1", 60)
    # READY=1 and the stderr line travel apart (the notify socket, a pipe read by a thread): wait for the line
    d.wait_log(re.escape("no fast path: no converged state is recorded"), 10)
    rc, took = d.stop()
    assert rc == 0 and took < 10
    assert (host / "var/lib/driverd/daemon/converged.json").is_file()

    state = tree_files(host / "var/lib/driverd")
    modules = (host / "proc/modules").read_bytes()
    pids = _daemon_pids(host)
    assert pids["nvidia-persistenced"] and not pids["nv-fabricmanager"], pids   # no NVSwitch: no fabric manager

    d = daemons(host, "container-entrypoint", env=env, root_arg=False)
    at, ready = d.wait_notify("READY=1", 10)
    assert at - d.started < 2.5, f"ready after {at - d.started:.2f}s"
    d.wait_log(re.escape(f"fast path: driver {OLD} (open) is loaded and valid"), 10)
    assert "STATUS=converged" in ready
    code, body = d.get("/readyz")
    assert code == 200 and OLD in body
    assert d.metric("driverd_driver_info", version=OLD, flavor="open", kernel=kernel_of(host).release) == 1
    time.sleep(0.5)
    rc, took = d.stop()
    assert rc == 0 and took < 10
    assert tree_files(host / "var/lib/driverd") == state            # no journal run, nothing written
    assert (host / "proc/modules").read_bytes() == modules           # nothing unloaded or loaded
    assert _daemon_pids(host) == pids                               # daemons not restarted
    assert "> " not in d.log                                        # no step ran

    # A changed configuration is not the fast path: the new parameter is applied by a reload.
    write_config(host, OLD, repo, extra='[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "18"\n')
    d = daemons(host, "container-entrypoint", env=env, root_arg=False)
    d.wait_notify("READY=1", 60)
    d.wait_log(re.escape("no fast path: the configuration, kernel or installed driver (package or user-space) changed"), 10)
    assert journal_runs(host)[-1]["command"] == "reload"
    assert kernel_of(host).modules()["nvidia"].parameters["NVreg_EnableGpuFirmware"] == "18"
    assert d.stop()[0] == 0


def test_unload_on_exit_unloads_through_a_journalled_request(host, packages, daemons):
    write_config(host, OLD, packages["old"].parent, daemon="unload_on_exit = true\n")
    d = daemons(host, "container-entrypoint")
    d.wait_notify("READY=1", 60)
    rc, took = d.stop()
    assert rc == 0 and took < 10, d.log
    assert "daemon.unload_on_exit: unload done" in d.log
    assert not kernel_of(host).is_loaded("nvidia")
    last = journal_runs(host)[-1]
    assert last["command"] == "unload" and last["state"] == "done"
    assert not any(_daemon_pids(host).values())


def test_service_link_variables_do_not_stop_the_driver_container(host, packages, daemons):
    """issue 32: a Service named driverd-metrics in the pod's namespace gave the container
    DRIVERD_METRICS_SERVICE_HOST, DRIVERD_METRICS_PORT_9477_TCP_ADDR, ...; the configuration refused them as
    unknown and the pod never became ready."""
    from tests.test_config_service_links import service_links
    write_config(host, OLD, packages["old"].parent)
    env = {"DRIVERD_ROOT": str(host), **service_links("driverd", [("metrics", 9477, "TCP")]),
           **service_links("driverd-metrics", [("http-metrics", 9477, "TCP")])}
    d = daemons(host, "container-entrypoint", env=env, root_arg=False)
    d.wait_notify("READY=1", 60)
    assert "unknown environment variable" not in d.log and "cannot be used" not in d.log
    assert d.get("/readyz")[0] == 200
    assert d.stop()[0] == 0
