"""CRI-O, Docker, CDI, revert and bad input. CRI-O and Docker cannot run here: their results are
checked with the rules those daemons apply (CRI-O: TOML, main file then crio.conf.d in lexical
order, later wins, runtime tables merged by name; Docker: one JSON object)."""
from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import Options, configure, revert
from driverd.runtime import cdi
from driverd.runtime.state import STATE_FILE
from tests.conftest import run_cli
from tests.runtime.conftest import RT, make_host, snapshot

BIN = "/usr/bin/nvidia-container-runtime"


def _opts(**kw) -> Options:
    return Options(**{"restart": "none", **kw})


def crio_effective(host: Path, confdir: str = "/etc/crio/crio.conf.d") -> dict:
    """CRI-O's view: crio.conf, then drop-ins in lexical order; later files win per option."""
    def merge(a, b):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out
    eff = tomllib.loads((host / "etc/crio/crio.conf").read_text())
    d = host / confdir.lstrip("/")
    for f in sorted(d.iterdir()) if d.is_dir() else []:
        eff = merge(eff, tomllib.loads(f.read_text()))
    return eff


@pytest.fixture
def crio_host(tmp_path):
    return make_host(tmp_path / "host", {"/etc/crio/crio.conf": (RT / "crio/crio.conf").read_text()},
                     {"/usr/bin/crio": "1.30.0", BIN: ""})


def test_crio_dropin_inherits_and_sets_default(crio_host):
    before = snapshot(crio_host)
    rep = configure(Root(crio_host), "crio", _opts(set_as_default=True))
    assert rep.files_changed == ["/etc/crio/crio.conf.d/99-driverd-nvidia.conf"]
    assert (crio_host / "etc/crio/crio.conf").read_bytes() == before["etc/crio/crio.conf"]
    eff = crio_effective(crio_host)
    rts = eff["crio"]["runtime"]["runtimes"]
    assert set(rts) == {"runc", "crun", "nvidia"}
    nv = rts["nvidia"]
    # derives from the default runtime (crun): monitor and root inherited
    assert nv == {"runtime_path": BIN, "runtime_type": "oci", "runtime_root": "/run/crun",
                  "monitor_path": "/usr/bin/conmon", "monitor_env": ["PATH=/usr/bin"]}
    assert eff["crio"]["runtime"]["default_runtime"] == "nvidia"
    assert eff["crio"]["runtime"]["conmon_cgroup"] == "pod"
    assert configure(Root(crio_host), "crio", _opts(set_as_default=True)).files_changed == []
    revert(Root(crio_host), "crio", _opts())
    assert snapshot(crio_host) == before


def test_crio_uses_the_config_dir_its_service_passes(crio_host):
    unit = crio_host / "etc/systemd/system/crio.service.d/10-dir.conf"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=\nExecStart=/usr/bin/crio --config-dir /etc/crio/site.d $CRIO_FLAGS\n")
    rep = configure(Root(crio_host), "crio", _opts())
    assert rep.files_changed == ["/etc/crio/site.d/99-driverd-nvidia.conf"]
    assert "nvidia" in crio_effective(crio_host, "/etc/crio/site.d")["crio"]["runtime"]["runtimes"]


def test_crio_refuses_missing_binary_and_taken_name(crio_host):
    with pytest.raises(RuntimeConfigError, match="does not exist"):
        configure(Root(crio_host), "crio", _opts(binary="/opt/none/nvidia-container-runtime"))
    with pytest.raises(RuntimeConfigError, match="already exists") as e:
        configure(Root(crio_host), "crio", _opts(handler="runc"))
    assert e.value.exit_code == 3
    assert not (crio_host / "etc/crio/crio.conf.d").exists()


@pytest.fixture
def docker_host(tmp_path):
    return make_host(tmp_path / "host", {"/etc/docker/daemon.json": (RT / "docker/daemon.json").read_text()},
                     {"/usr/bin/dockerd": "27.1.0", BIN: ""})


def test_docker_merge_keeps_every_key(docker_host):
    before = snapshot(docker_host)
    orig = json.loads(before["etc/docker/daemon.json"])
    rep = configure(Root(docker_host), "docker", _opts(set_as_default=True, cdi=False))
    assert rep.files_changed == ["/etc/docker/daemon.json"]
    doc = json.loads((docker_host / "etc/docker/daemon.json").read_text())
    assert list(doc)[:len(orig)] == list(orig)                    # order kept
    assert doc["features"] == orig["features"] and doc["log-opts"] == orig["log-opts"]
    assert doc["runtimes"] == {**orig["runtimes"], "nvidia": {"path": BIN}}
    assert doc["default-runtime"] == "nvidia"
    assert configure(Root(docker_host), "docker", _opts(set_as_default=True)).files_changed == []
    revert(Root(docker_host), "docker", _opts())
    assert snapshot(docker_host) == before


def test_docker_revert_after_someone_else_edited_keeps_their_edit(docker_host):
    configure(Root(docker_host), "docker", _opts())
    p = docker_host / "etc/docker/daemon.json"
    doc = json.loads(p.read_text())
    doc["runtimes"]["kata"] = {"path": "/usr/bin/kata-runtime"}
    doc["debug"] = True
    p.write_text(json.dumps(doc, indent=2))
    rep = revert(Root(docker_host), "docker", _opts())
    after = json.loads(p.read_text())
    assert "nvidia" not in after["runtimes"] and "kata" in after["runtimes"] and "runsc" in after["runtimes"]
    assert after["debug"] is True and after["features"]["buildkit"] is True
    assert any("edited since" in n for n in rep.notes)


def test_docker_cdi_feature(docker_host):
    gpu_tree(docker_host, 2)
    configure(Root(docker_host), "docker", _opts(cdi=True))
    doc = json.loads((docker_host / "etc/docker/daemon.json").read_text())
    assert doc["features"] == {"buildkit": True, "containerd-snapshotter": True, "cdi": True}


def gpu_tree(host: Path, n: int, uvm: bool = True) -> list[str]:
    """`n` GPUs with plain-file device nodes (driver_trees.add_gpus), without the UVM nodes unless `uvm`."""
    from tests.runtime.driver_trees import add_gpus
    uuids = add_gpus(host, n, char_devices=False, caps=False)
    for name in () if uvm else ("nvidia-uvm", "nvidia-uvm-tools"):
        (host / "dev" / name).unlink()
    return uuids


def test_cdi_spec_from_proc_information(tmp_path):
    host = tmp_path / "h"
    uuids = gpu_tree(host, 2, uvm=False)
    spec = cdi.build(Root(host))
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    names = [d["name"] for d in spec["devices"]]
    assert names == ["0", uuids[0], "1", uuids[1], "all"]
    assert spec["devices"][-1]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}, {"path": "/dev/nvidia1"}]
    assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidiactl"}]    # only nodes that exist
    assert cdi.validate(yaml.safe_load(cdi.render(spec))) == []


@pytest.mark.parametrize("mutate,problem", [
    (lambda s: s.update(cdiVersion="0.9.9"), "not a released"),
    (lambda s: s.update(kind="nvidia"), "vendor/class"),
    (lambda s: s.update(kind="nvidia.com/g.pu"), "needs cdiVersion >= 0.6.0"),
    (lambda s: s["devices"][0].update(name="-bad"), "must start and end"),
    (lambda s: s["devices"].append(dict(s["devices"][0])), "duplicate name"),
    (lambda s: s["devices"][0].update(annotations={"a": "b"}), "needs cdiVersion >= 0.6.0"),
    (lambda s: s["devices"][0].update(containerEdits={}), "must not be empty"),
    (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(path="dev/x"), "absolute"),
    (lambda s: s["devices"].clear(), "at least one device"),
    (lambda s: s.update(extra=1), "unknown field"),
])
def test_cdi_validation_rejects(tmp_path, mutate, problem):
    gpu_tree(tmp_path, 1)
    spec = cdi.build(Root(tmp_path))
    mutate(spec)
    assert any(problem in p for p in cdi.validate(spec)), cdi.validate(spec)


def test_cdi_hostpath_needs_050():
    spec = {"cdiVersion": "0.4.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/dev/nvidia0"}]}}]}
    assert any(">= 0.5.0" in p for p in cdi.validate(spec))
    spec["cdiVersion"] = "0.5.0"
    assert cdi.validate(spec) == []


# -- bad input: one clear error, nothing written ------------------------------------------------
def _ctd_host(tmp_path, text: str, name="/etc/containerd/config.toml") -> Path:
    return make_host(tmp_path / "host", {name: text}, {"/usr/bin/containerd": "1.6.20", BIN: ""})


def test_malformed_toml_reports_line_and_column(tmp_path):
    host = _ctd_host(tmp_path, 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n  x = 1\n')
    before = snapshot(host, "")
    with pytest.raises(RuntimeConfigError, match=r"not valid TOML \(line 2, column \d+\)"):
        configure(Root(host), "containerd", _opts())
    assert snapshot(host, "") == before


def test_malformed_json_reports_line_and_column(tmp_path):
    host = make_host(tmp_path / "host", {"/etc/docker/daemon.json": '{\n  "a": 1,\n  "b": \n}\n'}, {BIN: ""})
    before = snapshot(host, "")
    with pytest.raises(RuntimeConfigError, match=r"not valid JSON \(line 4, column 1\)"):
        configure(Root(host), "docker", _opts())
    assert snapshot(host, "") == before


def test_unsupported_version(tmp_path):
    host = _ctd_host(tmp_path, "version = 4\n")
    with pytest.raises(RuntimeConfigError, match="unsupported containerd config version 4"):
        configure(Root(host), "containerd", _opts())


def test_handler_taken_by_someone_else(tmp_path):
    text = (RT / "containerd/v2.toml").read_text().replace("{TMP}", "/tmp/x") + (
        '    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        '      runtime_type = "io.containerd.runc.v2"\n'
        '      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        '        BinaryName = "/opt/vendor/bin/other-runtime"\n')
    host = _ctd_host(tmp_path, text)
    before = snapshot(host, "")
    with pytest.raises(RuntimeConfigError, match="already exists.*not driverd's") as e:
        configure(Root(host), "containerd", _opts())
    assert e.value.exit_code == 3 and snapshot(host, "") == before
    # the same handler pointing at our binary: nothing to do, and revert never removes it
    host2 = _ctd_host(tmp_path / "b", text.replace("/opt/vendor/bin/other-runtime", BIN))
    rep = configure(Root(host2), "containerd", _opts())
    assert rep.files_changed == [] and "left as it is" in " ".join(rep.notes)
    assert revert(Root(host2), "containerd", _opts()).skipped


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a read-only bind mount")
def test_read_only_file_system(tmp_path):
    import subprocess
    host = _ctd_host(tmp_path, (RT / "containerd/v2.toml").read_text())
    before = snapshot(host, "")
    script = ("mount --bind \"$0\" \"$0\" && mount -o remount,bind,ro \"$0\" && "
              "exec \"$1\" -m driverd runtime configure --root \"$0\" --runtime containerd --restart none")
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(host),
                          os.sys.executable], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                              "DRIVERD_MODULES_KERNEL": "real"})      # a bare tree, not a simulated host
    assert res.returncode == 3, res.stderr
    assert "read-only" in res.stderr and res.stderr.count("\n") == 1
    assert snapshot(host, "") == before


def test_revert_after_user_edit_removes_only_ours(tmp_path):
    host = _ctd_host(tmp_path, (RT / "containerd/v2.toml").read_text())
    configure(Root(host), "containerd", _opts(set_as_default=True))
    p = host / "etc/containerd/config.toml"
    p.write_text(p.read_text() + '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gvisor]\n'
                 '  runtime_type = "io.containerd.runsc.v1"\n')
    revert(Root(host), "containerd", _opts())
    doc = tomllib.loads(p.read_text())
    c = doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
    assert set(c["runtimes"]) == {"runc", "kata", "gvisor"} and c["default_runtime_name"] == "runc"
    assert "# runc with the systemd cgroup driver, as kubeadm wants" in p.read_text()
    assert not (host / STATE_FILE.lstrip("/")).read_text().count("containerd")


def test_detect_sees_the_handler_after_configure(tmp_path):
    from driverd.host.runtimes import read_runtimes
    host = _ctd_host(tmp_path, (RT / "containerd/v3.toml").read_text())
    assert not read_runtimes(Root(host))[0].nvidia_handler
    configure(Root(host), "containerd", _opts())
    assert read_runtimes(Root(host))[0].nvidia_handler


def test_cli_dry_run_then_configure_then_revert(tmp_path):
    host = _ctd_host(tmp_path, (RT / "containerd/v2.toml").read_text())
    before = snapshot(host, "")
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "containerd", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "+      [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia]" in res.stdout or \
        '+[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]' in res.stdout
    assert snapshot(host, "") == before
    res = run_cli("runtime", "configure", "--root", str(host), "--json", "--restart", "none")
    rep = json.loads(res.stdout)["reports"][0]
    assert rep["runtime"] == "containerd" and rep["files_changed"] == ["/etc/containerd/config.toml"]
    res = run_cli("runtime", "revert", "--root", str(host), "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert (host / "etc/containerd/config.toml").read_bytes() == before["etc/containerd/config.toml"]


def test_restart_systemd_dry_run_goes_through_the_host_root(tmp_path):
    from driverd.runner import Runner
    host = _ctd_host(tmp_path, (RT / "containerd/v2.toml").read_text())
    runner = Runner(dry_run=True)
    rep = configure(Root(host), "containerd", Options(restart="systemd", dry_run=True), runner)
    assert rep.restart_detail == (f"would run: chroot {host} systemctl try-restart --no-block containerd "
                                  "(only if containerd is active)")
    assert not (host / STATE_FILE.lstrip("/")).exists()


def test_a_failed_first_run_leaves_no_backup_that_a_later_revert_would_restore(tmp_path):
    """Issue 44, item 7: a first configure that fails after taking its backup (here the record cannot be
    saved: its name is taken by a directory) left that backup behind, unrecorded; the admin then edited the
    file, the next configure kept the stale backup as "the original", and its revert put the old bytes back
    over the admin's edit. Now the failed run removes its backup and a new record takes a fresh one."""
    original = (RT / "containerd/v2.toml").read_text()
    host = _ctd_host(tmp_path, original)
    blocker = host / STATE_FILE.lstrip("/")
    (blocker / "x").mkdir(parents=True)              # the record cannot be written: the run fails
    with pytest.raises(RuntimeConfigError):
        configure(Root(host), "containerd", _opts())
    p = host / "etc/containerd/config.toml"
    assert p.read_text() == original
    backups = host / "var/lib/driverd/runtime/backups"
    assert not backups.exists() or not any(backups.iterdir()), list(backups.iterdir())
    shutil.rmtree(blocker)
    edited = original + '\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.gvisor]\n' \
                        '  runtime_type = "io.containerd.runsc.v1"\n'
    p.write_text(edited)                               # the admin's edit, after the failed run
    configure(Root(host), "containerd", _opts())
    revert(Root(host), "containerd", _opts())
    assert p.read_text() == edited


def test_two_files_whose_backup_names_once_collided_revert_to_their_own_bytes(tmp_path):
    """Issue 44, item 7: backups were named by the path with '/' made '__': /etc/a__b/c.conf and
    /etc/a/b__c.conf shared one backup, and revert gave the second file the first one's bytes."""
    from driverd.runtime import state
    from driverd.runtime.changes import ChangeReport, FileEdit
    host = make_host(tmp_path / "host", {"/etc/rt/a__b/c.conf": "first original\n",
                                         "/etc/rt/a/b__c.conf": "second original\n"})
    root = Root(host)
    edits = [FileEdit(hp, f"{old}# driverd: nvidia\n".encode(), old.encode(), "block", [], "nvidia")
             for hp, old in (("/etc/rt/a__b/c.conf", "first original\n"), ("/etc/rt/a/b__c.conf", "second original\n"))]
    rep = ChangeReport("containerd", "nvidia")
    state.apply(root, "containerd", "nvidia", edits, rep, dry_run=False)
    assert len(set(rep.backups)) == 2, rep.backups
    state.revert(root, "containerd", ChangeReport("containerd", "nvidia", "revert"), dry_run=False)
    assert (host / "etc/rt/a__b/c.conf").read_text() == "first original\n"
    assert (host / "etc/rt/a/b__c.conf").read_text() == "second original\n"


def test_the_runtime_record_lives_under_state_dir_and_an_older_one_is_moved_there(tmp_path):
    """Issue 45: driverd's record of its runtime changes (and the originals it backs up) go under state.dir,
    not a fixed /var/lib/driverd; a record an older driverd left at the fixed place is still reverted from."""
    original = (RT / "containerd/v2.toml").read_text()
    host = _ctd_host(tmp_path, original)
    (host / "etc/driverd").mkdir(parents=True)
    (host / "etc/driverd/config.toml").write_text('[state]\ndir = "/srv/driverd"\n')
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "containerd", "--restart", "none")
    assert res.returncode == 0, res.stderr
    rec = json.loads((host / "srv/driverd/runtime/state.json").read_text())
    backup = rec["runtimes"]["containerd"]["files"]["/etc/containerd/config.toml"]["backup"]
    assert backup.startswith("/srv/driverd/runtime/backups/") and (host / backup.lstrip("/")).is_file()
    assert not (host / "var/lib/driverd/runtime").exists()
    res = run_cli("runtime", "revert", "--root", str(host), "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert (host / "etc/containerd/config.toml").read_text() == original

    # an older driverd's record, at the fixed place whatever state.dir said: reverted, and moved
    (host / "srv/driverd/runtime/state.json").unlink()
    configure(Root(host), "containerd", _opts())
    assert (host / STATE_FILE.lstrip("/")).is_file()
    res = run_cli("runtime", "revert", "--root", str(host), "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert (host / "etc/containerd/config.toml").read_text() == original
    assert not (host / STATE_FILE.lstrip("/")).exists()
    assert json.loads((host / "srv/driverd/runtime/state.json").read_text())["runtimes"] == {}
