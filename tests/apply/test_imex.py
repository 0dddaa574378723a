"""Issue 46: IMEX on NVLink5 IMEX trays (GB200/GB300), switched with the driver in one transaction.

A simulated GB200 NVL72 compute tray (driverd.sim.scenario.gb200_spec: aarch64, Grace, four GB200 GPUs) runs a
driver with driverd's IMEX companion of its version; the next version's kernel package and IMEX companion are
in a local repository, the companion built by build-companion from an archive in NVIDIA's layout made by the test
(no real archive is reachable here); its nvidia-imex is the version-checking stand-in (driverd/sim/companiond.py),
which refuses another driver as NVIDIA's does. The upgrade is the HGX tests' 535 -> 550 in shape, with versions
that support the GB200 (NVIDIA's open-modules READMEs list it from 570.123.01): 570 -> 580."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from driverd.driver.companions import CompanionPlaces, current
from driverd.install import companion as ci
from driverd.install.modules import install
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim import companiond
from driverd.sim.scenario import companion_archive, gb200_spec, make_companion_packages, make_host
from tests.apply.conftest import drv, journal, kernel_of

OLD, NEW = "570.172.08", "580.95.05"
RELEASE, ARCH = gb200_spec().release, "aarch64"
P = CompanionPlaces("imex")
CH0 = "dev/nvidia-caps-imex-channels/channel0"
REG = "var/lib/kubelet/plugins_registry/compute-domain.nvidia.com-reg.sock"


@pytest.fixture(scope="module")
def gb200_packages(tmp_path_factory):
    """The OLD and NEW kernel packages built for the tray's kernel (aarch64) and both IMEX companions."""
    from driverd.sim.fakepkg import make_fake_package
    out = tmp_path_factory.mktemp("gb200-pkgs")
    pk = {v: make_fake_package(out / "kernel", v, RELEASE, arch=ARCH).path for v in (OLD, NEW)}
    imex = make_companion_packages(out / "imex", (OLD, NEW), ARCH, components=("imex",))
    return {"kernel": pk, "imex": {v: imex[("imex", v)] for v in (OLD, NEW)}, "dir": out}


def _config(root, text: str) -> None:
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(text)


def _repo(tmp_path, gb200_packages, *, imex: bool = True):
    from driverd.repo.index import write_index
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(gb200_packages["kernel"][NEW], repo)
    if imex:
        shutil.copy(gb200_packages["imex"][NEW], repo)
    write_index(repo)
    return repo


def _want_new(root, repo, extra: str = "") -> None:
    _config(root, f'[driver]\nversion = "{NEW}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                  f'[companions]\nfetch = true\n[runtime]\nrestart = "none"\n{extra}')


def _tray(tmp_path, gb200_packages, *, imex_tree: bool = True, host_imex: bool = False):
    """The GB200 tray running OLD with driverd's OLD IMEX (from its companion tree), loaded by driverd, with the
    operator's choice of no IMEX channel 0 (so that the upgrade's load is seen to make it)."""
    root = make_host(tmp_path / "root", gb200_spec())
    install(Root(root), gb200_packages["kernel"][OLD], Runner())
    if imex_tree:
        ci.install(Root(root), gb200_packages["imex"][OLD], places=P, driver=OLD)
    if host_imex:                                              # the distribution's, of the host's driver
        companiond.write(root / "usr/bin/nvidia-imex", "imex", OLD)
    _config(root, f'[driver]\nversion = "{OLD}"\nflavor = "open"\n[runtime]\nrestart = "none"\n'
                  '[modules.parameters.nvidia]\nNVreg_CreateImexChannel0 = "0"\n')
    r = drv(root, "load")
    assert r.returncode == 0, r.stdout + r.stderr
    return root


def _imex_cmdlines(root) -> list[str]:
    return [p.read_text().replace("\0", " ") for p in (root / "proc").glob("*/cmdline")
            if (p.parent / "comm").read_text().strip() == "nvidia-imex"]


def _log(root) -> str:
    return (root / companiond.LOGS["imex"].lstrip("/")).read_text()


def test_the_stand_in_refuses_another_driver_and_says_its_version(tmp_path):
    exe = companiond.write(tmp_path / "usr/bin/nvidia-imex", "imex", NEW)
    env = {"PATH": "/usr/bin:/bin", "DRIVERD_SIM_ROOT": str(tmp_path)}
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "the NVIDIA driver is not loaded" in r.stderr
    version = tmp_path / "proc/driver/nvidia/version"
    version.parent.mkdir(parents=True)
    version.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {OLD}  Release Build\n")
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"IMEX version {NEW} does not match the NVIDIA driver version {OLD}" in r.stderr
    assert "does not match" in (tmp_path / "var/log/nvidia-imex.log").read_text()
    version.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {NEW}  Release Build\n")
    assert subprocess.run([str(exe)], env=env, timeout=30).returncode == 0
    r = subprocess.run([str(exe), "--version"], env=env, capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == f"IMEX version is: {NEW}"
    # NVLSM: its own version, the driver it goes with, and the InfiniBand MAD interface it needs
    sm = companiond.write(tmp_path / "opt/nvidia/nvlsm/sbin/nvlsm", "nvlsm", NEW)
    r = subprocess.run([str(sm)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "ib_umad is not loaded" in r.stderr
    (tmp_path / "sys/module/ib_umad").mkdir(parents=True)
    assert subprocess.run([str(sm)], env=env, timeout=30).returncode == 0
    version.write_text(f"NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {OLD}  Release Build\n")
    r = subprocess.run([str(sm)], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and f"goes with NVIDIA driver {NEW}, the loaded driver is {OLD}" in r.stderr


def test_a_gb200_upgrade_switches_imex_with_the_driver_and_makes_the_channel(tmp_path, gb200_packages):
    """Before: no IMEX was started at all (the plan knew only the fabric manager). Now the NEW IMEX companion is
    switched with the driver, IMEX NEW runs from driverd's tree, the load makes channel 0, and the CDI spec
    gives it to containers."""
    root = _tray(tmp_path, gb200_packages)
    assert _imex_cmdlines(root) and f"IMEX {OLD}: ready (driver {OLD})" in _log(root)   # OLD's IMEX runs with OLD
    assert not (root / CH0).exists()                                 # the operator asked for no channel 0 then
    _want_new(root, _repo(tmp_path, gb200_packages))
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    actions = [s["action"] for s in p["steps"]]
    assert actions.index("install-companion") < actions.index("load-modules") < actions.index("start-imex"), actions
    load = next(s for s in p["steps"] if s["action"] == "load-modules")
    assert load["params"]["parameters"]["nvidia"] == {"NVreg_CreateImexChannel0": "1"}, load
    assert "IMEX is driverd's" in p["fabric"], p["fabric"]
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert NEW in (root / "proc/driver/nvidia/version").read_text()
    assert current(Root(root), P).version == NEW
    cmd = _imex_cmdlines(root)       # one IMEX, driverd's, with its tree's configuration (the host has none)
    assert cmd == [f"{P.current}/bin/nvidia-imex -c {P.current}/etc/nvidia-imex/config.cfg "], cmd
    assert _log(root).rstrip().endswith(f"IMEX {NEW}: ready (driver {NEW})"), _log(root)
    assert (root / CH0).read_text().startswith("c 237:0")      # the region's major, channel 0
    order = [s["action"] for s in journal(root)["steps"]]
    assert order.index("stop-gpu-daemons") < order.index("unload-modules") < order.index("install-companion") \
        < order.index("load-modules") < order.index("start-imex"), order
    from driverd.runtime import cdi
    spec, _ = cdi.build_with_notes(Root(root))
    dev = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert dev["imex-channel0"] == [{"path": f"/{CH0}", "hostPath": f"/{CH0}"}], dev.keys()
    r = drv(root, "plan", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["verdict"] == "converged", r.stdout


def test_an_imex_of_another_version_blocks_the_upgrade_and_nothing_is_unloaded(tmp_path, gb200_packages):
    """The host's own nvidia-imex is the distribution's OLD and driverd has no NEW one (its repository lists
    none): loading NEW would start an IMEX that refuses it. Before, the plan went ahead; now it is BLOCKED, exit
    3, naming both versions and how to provide NEW's, and apply unloads nothing."""
    root = _tray(tmp_path, gb200_packages, imex_tree=False, host_imex=True)
    assert _imex_cmdlines(root) and "/usr/bin/nvidia-imex" in _imex_cmdlines(root)[0]     # the host's runs
    _want_new(root, _repo(tmp_path, gb200_packages, imex=False))
    r = drv(root, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert f"no IMEX of driver {NEW} is available: /usr/bin/nvidia-imex ({OLD}: its --version)" in r.stdout, r.stdout
    assert "driverd build-companion nvidia_imex-linux-<arch>" in r.stdout and 'daemons.imex = "false"' in r.stdout
    before = journal(root)["run_id"]
    r = drv(root, "apply")
    assert r.returncode == 3, r.stdout + r.stderr
    assert OLD in (root / "proc/driver/nvidia/version").read_text() and kernel_of(root).is_loaded("nvidia")
    assert journal(root)["run_id"] == before and _imex_cmdlines(root)


def test_the_dra_drivers_compute_domains_own_imex_and_driverd_starts_none(tmp_path, gb200_packages):
    """NVIDIA's DRA driver's compute-domain kubelet plugin is registered on the node: its ComputeDomains run IMEX
    themselves. Under daemons.imex = auto driverd leaves IMEX to them — the plan says who owns it and why, no
    IMEX is installed or started, and no channel 0 is made (the DRA driver makes its domains' channels) — and
    daemons.imex = true beside them is BLOCKED naming both owners."""
    root = _tray(tmp_path, gb200_packages)
    drv(root, "unload")
    assert not _imex_cmdlines(root)
    (root / REG).parent.mkdir(parents=True)
    (root / REG).write_text("")                        # a socket on a node; its name is what the kubelet watches
    _want_new(root, _repo(tmp_path, gb200_packages))
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    assert ("IMEX is owned by the DRA driver's ComputeDomains (the compute-domain.nvidia.com kubelet plugin is "
            f"registered: /{REG}): driverd starts none") in p["fabric"], p["fabric"]
    actions = [s["action"] for s in p["steps"]]
    assert "start-imex" not in actions and "install-companion" not in actions, actions
    assert next(s for s in p["steps"] if s["action"] == "load-modules")["params"]["parameters"] == {}
    assert "IMEX is owned by the DRA driver's ComputeDomains" in drv(root, "detect", "--no-nvml").stdout
    assert drv(root, "apply").returncode == 0
    assert NEW in (root / "proc/driver/nvidia/version").read_text()
    assert not _imex_cmdlines(root) and not (root / CH0).exists()
    assert current(Root(root), P).version == OLD                  # driverd's IMEX tree untouched
    # a ComputeDomain's IMEX daemon (its pod's process) is theirs; a host IMEX service beside them is named
    k = kernel_of(root)
    k.spawn("nvidia-imex", ["/dev/nvidiactl"], cgroup="0::/kubepods.slice/kubepods-pod0f3c1a2b_4d5e_4f60_8a9b_"
                                                      "0c1d2e3f4a5b.slice/cri-containerd-" + "a" * 64 + ".scope")
    p = json.loads(drv(root, "plan", "--json").stdout)
    assert p["verdict"] == "converged" and not [w for w in p["warnings"] if "IMEX service" in w], p
    pid = k.spawn("nvidia-imex", ["/dev/nvidiactl"], cgroup="0::/system.slice/nvidia-imex.service")
    p = json.loads(drv(root, "plan", "--json").stdout)
    assert [w for w in p["warnings"] if w.startswith(f"an IMEX service of the host runs (pid {pid}) beside the DRA")]
    k.signal(pid, 9)
    # an operator who also asks for a host IMEX service: refused before anything changes
    _want_new(root, tmp_path / "repo", '[daemons]\nimex = "true"\n')
    r = drv(root, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert ("daemons.imex = true, but NVIDIA's DRA driver's ComputeDomains own IMEX on this node (the "
            f"compute-domain.nvidia.com kubelet plugin is registered: /{REG})") in r.stdout, r.stdout
    assert 'set daemons.imex = "auto"' in r.stdout and "resources.computeDomains.enabled = false" in r.stdout
    assert drv(root, "apply").returncode == 3
    assert _imex_cmdlines(root) == ["nvidia-imex "]                 # the pod's alone: nothing started, nothing stopped


def test_the_compute_domain_plugins_leftover_directory_is_not_an_owner(tmp_path):
    """The plugin's directory outlives an uninstall (its checkpoint.json): it says nothing about who runs IMEX
    now; its sockets do."""
    from driverd.host.fabric import compute_domains
    d = tmp_path / "var/lib/kubelet/plugins/compute-domain.nvidia.com"
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text("{}")
    assert compute_domains(Root(tmp_path)) is None
    (d / "dra.sock").write_text("")
    assert "dra.sock" in compute_domains(Root(tmp_path))
    reg = tmp_path / "var/lib/kubelet/plugins_registry"
    reg.mkdir(parents=True)
    (reg / "gpu.nvidia.com-reg.sock").write_text("")
    (reg / "compute-domain.nvidia.com-7f3e2a-reg.sock").write_text("")        # the helper's rolling-update name
    assert compute_domains(Root(tmp_path)).endswith("/compute-domain.nvidia.com-7f3e2a-reg.sock")


def test_the_imex_archive_of_the_simulation_builds_for_both_arches(tmp_path):
    from driverd.build.companion import build_from_archive
    for arch in ("x86_64", "aarch64"):
        a, driver = companion_archive(tmp_path / arch, "imex", NEW, arch)
        assert driver is None and a.name == f"nvidia_imex-linux-{'sbsa' if arch == 'aarch64' else arch}-{NEW}" \
                                           "-archive.tar.xz"
        m = build_from_archive(a, tmp_path / "out").manifest
        assert (m.component, m.driver_version, m.arch) == ("imex", NEW, arch) and "bin/nvidia-imex" in m.binaries
