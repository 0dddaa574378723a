"""Taking over Docker and CRI-O handlers NVIDIA's tooling wrote (those daemons cannot run here: results
are checked with the rules they apply — see test_runtime_files), the CLI round trip on a daemon.json
written by `nvidia-ctk runtime configure --runtime=docker`, and revert after edits between runs."""
from __future__ import annotations

import json
import tomllib

import pytest

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import Options, configure, revert
from tests.conftest import run_cli
from tests.runtime.conftest import PEER, RT, make_host, snapshot
from tests.runtime.test_runtime_files import crio_effective

BIN = "/usr/bin/nvidia-container-runtime"
TOOLKIT = "/usr/local/nvidia/toolkit/nvidia-container-runtime"
DAEMON = "/etc/docker/daemon.json"


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", **kw})


def _docker(tmp_path, fixture: str, bins=(BIN,)):
    return make_host(tmp_path / "host", {DAEMON: (PEER / "docker" / fixture).read_text()},
                     {"/usr/bin/dockerd": "27.1.0", **{b: "" for b in bins}})


def _json(host) -> dict:
    return json.loads((host / DAEMON.lstrip("/")).read_text())


# -- Docker -------------------------------------------------------------------------------------------
def test_docker_nvidia_ctk_bare_name_is_adopted_and_made_absolute(tmp_path):
    host = _docker(tmp_path, "daemon-ctk.json")
    before = snapshot(host)
    rep = configure(Root(host), "docker", _opts())
    assert rep.files_changed == [DAEMON]
    assert rep.adopted == [{"handler": "nvidia", "file": DAEMON, "before": "nvidia-container-runtime", "binary": BIN,
                            "how": "the bare name 'nvidia-container-runtime' resolved on the host's PATH",
                            "foreign": False}]
    doc = _json(host)
    assert doc["runtimes"]["nvidia"] == {"args": [], "path": BIN}            # args kept, path absolute
    assert list(doc) == ["exec-opts", "log-driver", "runtimes"]
    assert configure(Root(host), "docker", _opts()).files_changed == []
    # flags on the adopted handler change exactly what they name
    was = _json(host)
    configure(Root(host), "docker", _opts(set_as_default=True))
    assert _json(host) == {**was, "default-runtime": "nvidia"}
    rev = revert(Root(host), "docker", _opts())
    assert any("goes back to what the other tool wrote (it ran nvidia-container-runtime)" in n for n in rev.notes)
    assert snapshot(host) == before                                        # byte for byte, no trailing newline


def test_docker_bare_name_not_on_the_host_path_gets_the_configured_binary(tmp_path):
    host = _docker(tmp_path, "daemon-ctk.json", bins=("/opt/nv/bin/nvidia-container-runtime",))
    rep = configure(Root(host), "docker", _opts(binary="/opt/nv/bin/nvidia-container-runtime"))
    assert _json(host)["runtimes"]["nvidia"]["path"] == "/opt/nv/bin/nvidia-container-runtime"
    assert rep.adopted[0]["how"] == "the configured binary"
    host2 = _docker(tmp_path / "b", "daemon-ctk.json", bins=())
    rep = configure(Root(host2), "docker", _opts())
    assert _json(host2)["runtimes"]["nvidia"]["path"] == BIN
    assert "not on the host's PATH" in rep.adopted[0]["how"]


def test_docker_operator_handler_kept_flags_already_there(tmp_path):
    host = _docker(tmp_path, "daemon-operator.json", bins=(BIN, TOOLKIT))
    before = snapshot(host)
    rep = configure(Root(host), "docker", _opts(set_as_default=True, cdi=True))
    assert rep.files_changed == [] and rep.skipped and "left as it is" in " ".join(rep.notes)
    rep = configure(Root(host), "docker", _opts(binary=BIN, binary_explicit=True))
    assert rep.files_changed == [DAEMON] and _json(host)["runtimes"]["nvidia"] == {"args": [], "path": BIN}
    revert(Root(host), "docker", _opts())
    assert snapshot(host) == before


def test_docker_foreign_handler_refused_then_replaced_on_request(tmp_path):
    host = _docker(tmp_path, "daemon-foreign.json")
    before = snapshot(host)
    with pytest.raises(RuntimeConfigError) as e:
        configure(Root(host), "docker", _opts())
    assert "runs '/opt/acme/bin/acme-gpu-runc'" in e.value.one_line() and "--adopt-foreign" in e.value.one_line()
    assert e.value.exit_code == 3 and snapshot(host) == before
    rep = configure(Root(host), "docker", _opts(adopt_foreign=True))
    assert _json(host)["runtimes"]["nvidia"] == {"path": BIN}              # its runtimeArgs were acme's
    assert rep.adopted[0]["foreign"]
    revert(Root(host), "docker", _opts())
    assert snapshot(host) == before


def test_cli_docker_nvidia_ctk_configure_adopts_and_revert_restores(tmp_path):
    host = _docker(tmp_path, "daemon-ctk.json")
    before = snapshot(host)
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "docker", "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert f"adopted  'nvidia' in {DAEMON}: ran nvidia-container-runtime, now {BIN}" in res.stdout
    assert _json(host)["runtimes"]["nvidia"]["path"] == BIN
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "docker", "--restart", "none", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["state"] == "nothing-to-do"
    res = run_cli("runtime", "revert", "--root", str(host), "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert snapshot(host) == before


def test_cli_foreign_docker_handler_one_line_then_adopt_foreign(tmp_path):
    host = _docker(tmp_path, "daemon-foreign.json")
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "docker", "--restart", "none")
    assert res.returncode == 3
    last = res.stderr.rstrip("\n").splitlines()[-1]
    assert "acme-gpu-runc" in last and "--adopt-foreign" in last and "Traceback" not in res.stderr
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "docker", "--restart", "none",
                  "--adopt-foreign")
    assert res.returncode == 0, res.stderr
    assert _json(host)["runtimes"]["nvidia"] == {"path": BIN}


# -- CRI-O ----------------------------------------------------------------------------------------------
def _crio(tmp_path, main: str, dropins: dict[str, str] | None = None, bins=(BIN,)):
    files = {"/etc/crio/crio.conf": main}
    files.update({f"/etc/crio/crio.conf.d/{n}": t for n, t in (dropins or {}).items()})
    return make_host(tmp_path / "host", files, {"/usr/bin/crio": "1.30.0", **{b: "" for b in bins}})


def test_crio_nvidia_ctk_dropin_read_after_ours_is_edited_in_place(tmp_path):
    host = _crio(tmp_path, (RT / "crio/crio.conf").read_text(), {"99-nvidia.toml": (PEER / "crio/99-nvidia.toml").read_text()},
                 bins=(BIN, TOOLKIT))
    before = snapshot(host)
    kept = configure(Root(host), "crio", _opts(set_as_default=True))
    assert kept.files_changed == [] and "left as it is" in " ".join(kept.notes)
    rep = configure(Root(host), "crio", _opts(binary=BIN, binary_explicit=True, set_as_default=True))
    assert rep.files_changed == ["/etc/crio/crio.conf.d/99-nvidia.toml"]     # sorts after 99-driverd-nvidia.conf
    assert not (host / "etc/crio/crio.conf.d/99-driverd-nvidia.conf").exists()
    eff = crio_effective(host)["crio"]["runtime"]
    assert eff["runtimes"]["nvidia"]["runtime_path"] == BIN and eff["runtimes"]["nvidia"]["monitor_path"] == "/usr/bin/conmon"
    assert eff["default_runtime"] == "nvidia"
    revert(Root(host), "crio", _opts())
    assert snapshot(host) == before


def test_crio_handler_in_crio_conf_is_carried_into_our_dropin(tmp_path):
    host = _crio(tmp_path, (PEER / "crio/crio.conf-with-nvidia").read_text())
    before = snapshot(host)
    rep = configure(Root(host), "crio", _opts(set_as_default=True))
    ours = "/etc/crio/crio.conf.d/99-driverd-nvidia.conf"
    assert rep.files_changed == [ours] and rep.adopted[0]["before"] == "/opt/old-toolkit/bin/nvidia-container-runtime"
    assert (host / "etc/crio/crio.conf").read_bytes() == before["etc/crio/crio.conf"]
    eff = crio_effective(host)["crio"]["runtime"]
    assert eff["runtimes"]["nvidia"] == {"runtime_path": BIN, "runtime_type": "oci", "runtime_root": "/run/runc",
                                         "monitor_path": "/usr/libexec/crio/conmon"}
    assert eff["default_runtime"] == "nvidia"
    again = configure(Root(host), "crio", _opts(set_as_default=True))
    assert again.files_changed == [] and not again.adopted
    revert(Root(host), "crio", _opts())
    assert snapshot(host) == before


def test_crio_foreign_handler_refused(tmp_path):
    text = (RT / "crio/crio.conf").read_text() + '\n[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/crun"\n'
    host = _crio(tmp_path, text)
    with pytest.raises(RuntimeConfigError) as e:
        configure(Root(host), "crio", _opts())
    assert "runs '/usr/bin/crun'" in e.value.one_line() and "--adopt-foreign" in e.value.one_line()
    assert e.value.exit_code == 3 and not (host / "etc/crio/crio.conf.d").exists()
    rep = configure(Root(host), "crio", _opts(adopt_foreign=True))
    assert crio_effective(host)["crio"]["runtime"]["runtimes"]["nvidia"]["runtime_path"] == BIN and rep.adopted


def test_detect_sees_crio_handlers_in_any_dropin_file(tmp_path):
    from driverd.host.runtimes import read_runtimes
    host = _crio(tmp_path, (RT / "crio/crio.conf").read_text(), {"99-nvidia.toml": (PEER / "crio/99-nvidia.toml").read_text()})
    crio = next(r for r in read_runtimes(Root(host)) if r.name == "crio")
    assert crio.nvidia_handler and "nvidia" in crio.handlers


# -- revert after someone edited between driverd's runs ------------------------------------------------
def test_revert_keeps_an_edit_made_between_two_driverd_runs(tmp_path):
    host = make_host(tmp_path / "host", {"/etc/containerd/config.toml": (RT / "containerd/v2.toml").read_text()},
                     {"/usr/bin/containerd": "1.7.24", BIN: ""})
    p = host / "etc/containerd/config.toml"
    configure(Root(host), "containerd", _opts())
    p.write_text(p.read_text() + '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gvisor]\n'
                 '  runtime_type = "io.containerd.runsc.v1"\n')
    configure(Root(host), "containerd", _opts(set_as_default=True))     # driverd writes again over their edit
    rev = revert(Root(host), "containerd", _opts())
    c = tomllib.loads(p.read_text())["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert set(c["runtimes"]) == {"runc", "kata", "gvisor"} and c["default_runtime_name"] == "runc"
    assert any("removed only driverd's changes" in n for n in rev.notes)


def test_options_from_config_know_whether_the_binary_was_asked_for(tmp_path):
    from driverd import config
    cfg = config.load(Root(tmp_path), environ={})
    assert not Options.from_config(cfg).binary_chosen
    assert Options.from_config(cfg, binary=BIN).binary_chosen          # --binary, even the default path
    cfg = config.load(Root(tmp_path), environ={"DRIVERD_RUNTIME_BINARY": BIN, "DRIVERD_RUNTIME_ADOPT_FOREIGN": "1"})
    opts = Options.from_config(cfg)
    assert opts.binary_chosen and opts.adopt_foreign
