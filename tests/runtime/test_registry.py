"""The runtime registry: every registered runtime implements the whole `Runtime` interface, and a runtime
added from the test side (a podman-like one, put into the registry's table here, no production file
edited) flows through detect, plan, the configuration, `driverd runtime configure`, the restart and
`driverd runtime revert` — what "adding a runtime is one file" means."""
from __future__ import annotations

import inspect
import json
import tomllib

import pytest

from driverd.root import Root
from driverd.runtime import registry
from driverd.runtime.base import Runtime, dig, read_toml
from driverd.runtime.changes import FileEdit
from driverd.sim.hosttree import HostSpec, h100, write_host

BIN = "/usr/bin/nvidia-container-runtime"


def test_every_registered_runtime_implements_the_whole_interface():
    assert registry.names() == ("containerd", "crio", "docker")       # detection order, as before
    for name, rt in registry.REGISTRY.items():
        assert isinstance(rt, Runtime) and rt.name == name
        assert not getattr(type(rt), "__abstractmethods__", None), (name, type(rt).__abstractmethods__)
        for attr in ("title", "binaries", "configs", "sockets", "process_names"):
            assert getattr(rt, attr), (name, attr)
        assert isinstance(rt.reloads_on_signal, bool) and isinstance(rt.checks_binary, bool)
        assert "{handler}" in rt.handler_failure, name
        assert type(rt).cdi is not Runtime.cdi, f"{name}: says nothing of CDI"      # each knows its own rules
        for p in rt.binaries + rt.configs + rt.sockets:
            assert p.startswith("/"), (name, p)
        for meth in ("detect", "effective_handlers", "configure", "revert", "unit", "handler_binary", "cdi",
                     "default_runtime"):
            base = inspect.signature(getattr(Runtime, meth))
            mine = inspect.signature(getattr(type(rt), meth))
            assert list(mine.parameters) == list(base.parameters), (name, meth, mine)


class Podman(Runtime):
    """A test-side runtime: podman reads runtimes from containers.conf's [engine.runtimes]
    (name = [paths]) and from every *.conf of containers.conf.d, later files winning."""
    name = "podman"
    title = "Podman"
    binaries = ("/usr/bin/podman",)
    configs = ("/etc/containers/containers.conf",)
    sockets = ("/run/podman/podman.sock",)
    process_names = ("podman",)
    reloads_on_signal = False
    DROPINS = "/etc/containers/containers.conf.d"

    def effective_handlers(self, root, config_path):
        files = ([config_path] if config_path else []) + sorted(root.glob(self.DROPINS, ".conf"))
        names: list[str] = []
        for f in files:
            names.extend(n for n in dig(read_toml(root, f), "engine", "runtimes") if n not in names)
        return names, None

    def configure(self, root, config_path, options, report, facts, record):
        path = f"{self.DROPINS}/99-driverd-{options.handler}.conf"
        new = f'[engine.runtimes]\n{options.handler} = ["{options.binary}"]\n'.encode()
        return [FileEdit(path, new, root.read_bytes(path), "owned")]


@pytest.fixture(autouse=True)
def _a_repository(monkeypatch):
    """A repository is configured: a plan that fetches is not blocked on "nothing can provide it"."""
    monkeypatch.setenv("DRIVERD_PACKAGES_REPOSITORIES", "file:///srv/driverd")


@pytest.fixture
def podman(monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "podman", Podman())
    return registry.REGISTRY["podman"]


def _host(tmp_path):
    return write_host(tmp_path / "host", HostSpec(pci=[h100("0000:1b:00.0")], files={
        "/usr/bin/podman": "", BIN: "", "/etc/containers/containers.conf": '[engine]\ncgroup_manager = "systemd"\n'}))


def _cli(capsys, *argv) -> dict:
    from driverd.cli import main
    capsys.readouterr()
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_a_runtime_added_to_the_registry_flows_through_detect_plan_configure_revert(tmp_path, capsys, podman):
    host = _host(tmp_path)
    root = str(host)
    # detect: the facts carry it, from its own files
    facts = _cli(capsys, "detect", "--root", root, "--no-nvml")
    (pm,) = [r for r in facts["runtimes"] if r["name"] == "podman"]
    assert pm["binary"] == "/usr/bin/podman" and pm["config_exists"] and not pm["nvidia_handler"]
    # what the handler needs: without hooks of its own, runtime.binary and CDI unknown
    assert (pm["needs"]["binary"], pm["needs"]["binary_from"]) == (BIN, "runtime.binary")
    assert pm["needs"]["cdi"]["supported"] is None and pm["needs"]["cdi_line"].startswith("CDI: unknown (driverd does "
                                                                                          "not know how Podman enables CDI)")
    # plan: a configure-runtime step for it
    plan = _cli(capsys, "plan", "--root", root, "--driver", "570.195.03")
    steps = [s for s in plan["steps"] if s["action"] == "configure-runtime"]
    assert [s["params"]["runtime"] for s in steps] == ["podman"], plan["steps"]
    # the configuration and the CLI accept its name (a config file naming it, --runtime podman)
    (host / "etc/driverd").mkdir(parents=True)
    (host / "etc/driverd/config.toml").write_text('[runtime]\nruntimes = ["podman"]\nrestart = "none"\n')
    out = _cli(capsys, "runtime", "configure", "--root", root)
    assert out["runtimes"] == ["podman"]
    (rep,) = out["reports"]
    dropin = "/etc/containers/containers.conf.d/99-driverd-nvidia.conf"
    assert rep["files_changed"] == [dropin]
    assert rep["restart_detail"] == "restart podman to apply the change (restart mode 'none')"
    assert tomllib.loads((host / dropin.lstrip("/")).read_text())["engine"]["runtimes"]["nvidia"] == [BIN]
    assert podman.detect(Root(host), "nvidia").nvidia_handler        # its effective config now has it
    plan = _cli(capsys, "plan", "--root", root, "--driver", "570.195.03")
    assert not [s for s in plan["steps"] if s["action"] == "configure-runtime"]
    again = _cli(capsys, "runtime", "configure", "--root", root, "--runtime", "podman")
    assert again["state"] == "nothing-to-do" and again["reports"] == []                # idempotent
    # restart: a signal restart asks the registry whether it reloads on a signal
    from driverd.runner import Runner
    from driverd.runtime.restart import restart
    ok, what, _ = restart(Root(host), "podman", "podman", None, "signal", Runner())
    assert not ok and what.startswith("podman does not reload its configuration on a signal")
    # revert: driverd's record undoes it like any runtime's
    out = _cli(capsys, "runtime", "revert", "--root", root)
    assert [r["runtime"] for r in out["reports"]] == ["podman"]
    assert out["reports"][0]["files_changed"] == [dropin] and not (host / dropin.lstrip("/")).exists()
    assert not podman.detect(Root(host), "nvidia").nvidia_handler


def test_without_the_registry_entry_the_name_is_refused(tmp_path):
    from driverd.config import ConfigError, load
    host = _host(tmp_path)
    (host / "etc/driverd").mkdir(parents=True)
    (host / "etc/driverd/config.toml").write_text('[runtime]\nruntimes = ["podman"]\n')
    with pytest.raises(ConfigError) as e:
        load(Root(host))
    assert "one of auto, containerd, crio, docker, none" in e.value.one_line()
    assert "podman" not in [r.name for r in registry.detect_all(Root(host))]
