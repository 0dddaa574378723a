"""Writes through the real CLI land inside --root, whatever the host tree's symlinks say:
`var/run -> /run` (Debian/Ubuntu) puts the CDI spec in <root>/run/cdi, never in this machine's /run;
a hostile `etc/modprobe.d -> /etc/modprobe.d` (a loop inside the root) is a one-line error, and nothing
is written anywhere."""
from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from tests.conftest import KERNEL_ENV_REAL, run_cli
from tests.runtime.conftest import RT, make_host
from tests.runtime.test_runtime_files import BIN, gpu_tree


def _state(path: str):
    try:
        st = os.lstat(path)
        return st.st_mtime_ns, st.st_size
    except FileNotFoundError:
        return None


def _files(p: Path) -> dict[str, str]:
    return {str(x.relative_to(p)): (os.readlink(x) if x.is_symlink() else "dir" if x.is_dir() else x.read_text())
            for x in sorted(p.rglob("*"))}


def _debian_host(tmp_path: Path) -> Path:
    host = make_host(tmp_path / "host", {"/etc/containerd/config.toml": (RT / "containerd/v2.toml").read_text()},
                     {"/usr/bin/containerd": "1.7.24", BIN: ""})
    (host / "run").mkdir()
    os.symlink("/run", host / "var/run")          # absolute, as on Debian and Ubuntu
    os.symlink("/run/lock", host / "var/lock")
    gpu_tree(host, 2)
    return host


def test_cdi_spec_through_var_run_lands_in_root_run(tmp_path):
    host = _debian_host(tmp_path)
    real_before = {p: _state(p) for p in ("/run/cdi/nvidia.yaml", "/var/run/cdi/nvidia.yaml")}
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "containerd", "--cdi",
                  "--restart", "none", "--json")
    assert res.returncode == 0, res.stderr
    spec = yaml.safe_load((host / "run/cdi/nvidia.yaml").read_text())
    assert spec["kind"] == "nvidia.com/gpu" and [d["name"] for d in spec["devices"]][-1] == "all"
    assert os.readlink(host / "var/run") == "/run"              # the link is kept, not replaced by a dir
    assert {p: _state(p) for p in real_before} == real_before   # this machine's /run: untouched
    out = json.dumps(json.loads(res.stdout))
    assert "/var/run/cdi/nvidia.yaml" in out
    # revert removes exactly that file, through the same link
    res = run_cli("runtime", "revert", "--root", str(host), "--runtime", "cdi", "--restart", "none")
    assert res.returncode == 0, res.stderr
    assert not (host / "run/cdi/nvidia.yaml").exists() and os.path.islink(host / "var/run")
    assert {p: _state(p) for p in real_before} == real_before


def test_nouveau_blacklist_with_hostile_modprobe_d_is_one_line_and_writes_nothing(tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host as make_sim_host
    host = tmp_path / "host"
    make_sim_host(host, dgx_spec(gpus=1, nvswitches=0, nic=False, nouveau=True))
    (host / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (host / "etc/driverd/config.toml").write_text(
        f'[driver]\nversion = "535.261.03"\nflavor = "open"\n[packages]\nrepositories = ["file://{tmp_path}/repo"]\n'
        '[runtime]\nruntimes = ["containerd"]\nrestart = "none"\n')
    md = host / "etc/modprobe.d"
    if md.is_dir() and not md.is_symlink():
        for f in md.iterdir():
            f.unlink()
        md.rmdir()
    os.symlink("/etc/modprobe.d", md)               # points at itself inside the root: a loop
    real_before = sorted(os.listdir("/etc/modprobe.d")) if os.path.isdir("/etc/modprobe.d") else None
    res = run_cli("apply", "--root", str(host))
    assert res.returncode == 3, res.stdout + res.stderr
    last = res.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("driverd: error:") and "blacklist-nouveau" in last
    assert "/etc/modprobe.d" in last and "too many levels of symbolic links" in last and "fix:" in last
    assert "Traceback" not in res.stderr
    assert os.readlink(md) == "/etc/modprobe.d"
    assert not [p for p in _files(host) if "driverd-blacklist-nouveau" in p]
    after = sorted(os.listdir("/etc/modprobe.d")) if os.path.isdir("/etc/modprobe.d") else None
    assert after == real_before


def test_runtime_config_behind_a_looping_link_is_one_line(tmp_path):
    host = make_host(tmp_path / "host", {}, {"/usr/bin/containerd": "1.7.24", BIN: ""})
    (host / "etc").mkdir(exist_ok=True)
    os.symlink("/etc/containerd", host / "etc/containerd")     # etc/containerd -> itself
    before = _files(host)
    # (a bare tree, not a simulated host: the real kernel boundary, which only reads it)
    res = run_cli("runtime", "configure", "--root", str(host), "--runtime", "containerd", "--restart", "none",
                  env=KERNEL_ENV_REAL)
    assert res.returncode == 3, res.stdout + res.stderr
    last = res.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("driverd: error:") and "/etc/containerd" in last and "symbolic links" in last
    assert "Traceback" not in res.stderr
    after = {k: v for k, v in _files(host).items() if not k.startswith("var/lib/driverd")}
    assert after == {k: v for k, v in before.items() if not k.startswith("var/lib/driverd")}
