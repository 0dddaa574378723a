"""The plan and a handler whose binary is missing (driverd.runtime.needs in the facts): the handler is
still added — nvidia-container-toolkit may come after driverd — with a reason and a warning that
name the binary and the fixes, never a block; a configured handler whose binary is gone is a warning;
CRI-O, which refuses such a handler, gets no step until the binary exists. Text and --json."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.conftest import PEER, RT, gpu_host, install_binary

BIN = "/usr/bin/nvidia-container-runtime"
CFG = "/etc/containerd/config.toml"


@pytest.fixture(autouse=True)
def _a_repository(monkeypatch):
    """A repository is configured: a plan that fetches is not blocked on "nothing can provide it"."""
    monkeypatch.setenv("DRIVERD_PACKAGES_REPOSITORIES", "file:///srv/driverd")


def _text(path: Path) -> str:
    return path.read_text().replace("{TMP}", "/var/lib/containerd-test")


def _cli(capsys, *argv, as_json: bool = True):
    from driverd.cli import main
    capsys.readouterr()
    rc = main([*argv, *(["--json"] if as_json else [])])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out) if as_json else out


def test_plan_adds_the_handler_but_warns_when_its_binary_is_missing_and_does_not_block(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {CFG: _text(RT / "containerd/v2.toml")}, {"/usr/bin/containerd": "1.6.20~ds1"})
    p = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03")
    step = next(s for s in p["steps"] if s["action"] == "configure-runtime")
    assert step["params"]["runtime"] == "containerd"
    assert f"it will run {BIN}, which is missing: added now, it works once the binary is installed" in step["reason"]
    warning = next(w for w in p["warnings"] if w.startswith("containerd 1.6.20~ds1: handler 'nvidia'"))
    assert f"{BIN} (runtime.binary) missing" in warning and "install nvidia-container-toolkit" in warning
    assert p["blocked_by"] == [] and p["verdict"] == "steps"
    (n,) = p["runtimes"]
    assert (n["runtime"], n["status"], n["verdict"]) == ("containerd", "binary-missing", warning)
    text = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03", as_json=False)
    assert f"runtimes:\n  warning: {warning}\n  CDI: not supported" in text
    assert text.count(warning) == 1                   # printed once, in its runtime's section
    install_binary(host)
    p = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03")
    assert not any("nvidia-container-runtime" in w for w in p["warnings"])
    assert p["runtimes"][0]["status"] == "not-configured"


def test_a_configured_handler_whose_binary_is_gone_is_a_plan_warning_not_silence(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {CFG: _text(PEER / "containerd/ctk-v2-inplace.toml")}, {"/usr/bin/containerd": "2.1.9"})
    p = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03")
    assert not [s for s in p["steps"] if s["action"] == "configure-runtime"]     # nothing to add
    assert any(w.startswith("containerd 2.1.9: handler 'nvidia' configured, /usr/bin/nvidia-container-runtime "
                            "missing: pods with runtimeClassName nvidia will fail to start") for w in p["warnings"])


def test_crio_gets_no_configure_step_until_the_binary_exists(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {"/etc/crio/crio.conf": (RT / "crio/crio.conf").read_text()}, {"/usr/bin/crio": "1.30.4"})
    p = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03")
    assert not [s for s in p["steps"] if s["action"] == "configure-runtime"]    # CRI-O's configure would refuse
    assert p["blocked_by"] == []
    assert any("handler 'nvidia' not configured, /usr/bin/nvidia-container-runtime (runtime.binary) missing: driverd "
               "adds it only once the binary exists" in w for w in p["warnings"])
    install_binary(host)
    p = _cli(capsys, "plan", "--root", str(host), "--driver", "570.195.03")
    assert [s["params"]["runtime"] for s in p["steps"] if s["action"] == "configure-runtime"] == ["crio"]


def test_a_host_managed_driver_plan_says_the_same(tmp_path, capsys):
    host = gpu_host(tmp_path / "host", {CFG: _text(RT / "containerd/v2.toml"),
                                        "/etc/driverd/config.toml": '[driver]\nmanage = "never"\n'},
                    {"/usr/bin/containerd": "2.1.9"})
    p = _cli(capsys, "plan", "--root", str(host))
    assert p["driver_managed_by"] and [s["action"] for s in p["steps"]] == ["configure-runtime"]
    assert [n["status"] for n in p["runtimes"]] == ["binary-missing"]
    assert any(w.startswith("containerd 2.1.9: handler 'nvidia' not configured") for w in p["warnings"])
    text = _cli(capsys, "plan", "--root", str(host), as_json=False)
    assert "runtimes:\n  warning: containerd 2.1.9: handler 'nvidia' not configured" in text
    assert "  CDI: on (enable_cdi is not set: on by default since containerd 2.0); no spec for nvidia.com/gpu" in text
