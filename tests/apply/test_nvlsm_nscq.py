"""Issue 46: the other companions in the driver's transaction — NVLSM on HGX B200 (NVLink5 switch trays managed
from the host: NVLSM configures them through the ConnectX functions' InfiniBand MAD interface, then the fabric
manager routes them) and NSCQ on NVSwitch hosts (the library nvidia-smi and DCGM read the switches through; never
a block). The companions are built by build-companion from archives in NVIDIA's layout made by the simulation
(no real archive is reachable here); the daemons are the version-checking stand-ins (driverd/sim/fabricmanager.py,
driverd/sim/companiond.py), NSCQ's library a real ELF object with NVIDIA's soname."""
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
from driverd.sim.scenario import RELEASE, dgx_spec, hgx_b200_spec, make_companion_packages, make_host
from tests.apply.conftest import drv, journal, kernel_of

# B200 is listed by NVIDIA's open-modules READMEs from the 570 branch: the HGX 535 -> 550 upgrade's shape, 570 -> 580
OLD, NEW = "570.172.08", "580.95.05"
FM, NVLSM, NSCQ = (CompanionPlaces(c) for c in ("fabricmanager", "nvlsm", "nscq"))


@pytest.fixture(scope="module")
def b200_packages(tmp_path_factory):
    from driverd.sim.fakepkg import make_fake_package
    out = tmp_path_factory.mktemp("b200-pkgs")
    kernel = {v: make_fake_package(out / "kernel", v, RELEASE).path for v in (OLD, NEW)}
    comp = make_companion_packages(out / "companions", (OLD, NEW), components=("fabricmanager", "nvlsm"))
    return {"kernel": kernel, **{c: {v: comp[(c, v)] for v in (OLD, NEW)} for c in ("fabricmanager", "nvlsm")}}


def _config(root, text: str) -> None:
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(text)


def _procs(root) -> dict[str, int]:
    """comm -> pid of the simulated processes."""
    return {(p.parent / "comm").read_text().strip(): int(p.parent.name) for p in (root / "proc").glob("*/comm")
            if p.parent.name.isdigit()}


def _b200(tmp_path, pk, *, ib_umad: bool = True):
    """An HGX B200 host (8 B200 GPUs, the baseboard's ConnectX bridge with SW_MNG) running OLD with driverd's OLD
    fabric manager and NVLSM, loaded by driverd."""
    root = make_host(tmp_path / "root", hgx_b200_spec(ib_umad=ib_umad))
    install(Root(root), pk["kernel"][OLD], Runner())
    ci.install(Root(root), pk["fabricmanager"][OLD], places=FM, driver=OLD)
    ci.install(Root(root), pk["nvlsm"][OLD], places=NVLSM, driver=OLD)
    _config(root, f'[driver]\nversion = "{OLD}"\nflavor = "open"\n[runtime]\nrestart = "none"\n')
    return root


def test_b200_upgrade_starts_nvlsm_of_the_new_driver_before_its_fabric_manager(tmp_path, b200_packages):
    """Before: the plan started the fabric manager alone and NVLSM never ran, so the switch trays stayed
    unconfigured. Now both companions are switched with the driver and NVLSM starts first, from its tree, once
    mlx5_core, ib_core and ib_umad are up."""
    root = _b200(tmp_path, b200_packages)
    assert drv(root, "load").returncode == 0
    before = _procs(root)
    assert "nvlsm" in before and before["nvlsm"] < before["nv-fabricmanage"], before
    from driverd.repo.index import write_index
    repo = tmp_path / "repo"
    repo.mkdir()
    for p in (b200_packages["kernel"][NEW], b200_packages["fabricmanager"][NEW], b200_packages["nvlsm"][NEW]):
        shutil.copy(p, repo)
    write_index(repo)
    _config(root, f'[driver]\nversion = "{NEW}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                  '[companions]\nfetch = true\n[runtime]\nrestart = "none"\n')
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    steps = json.loads(r.stdout)["steps"]
    nvlsm = next(s for s in steps if s["action"] == "start-nvlsm")
    assert "after mlx5_core, ib_core, ib_umad" in nvlsm["reason"] and "not loaded yet" not in nvlsm["reason"], nvlsm
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert NEW in (root / "proc/driver/nvidia/version").read_text()
    assert current(Root(root), FM).version == NEW and current(Root(root), NVLSM).version == NEW
    after = _procs(root)
    assert after["nvlsm"] < after["nv-fabricmanage"], after            # NVLSM first
    log = (root / "var/log/nvlsm.log").read_text()
    assert log.rstrip().endswith(f"(driver {NEW}): NVLink5 switch trays configured"), log
    assert (root / "run/driverd-sim/fabric-state").read_text() == "completed\n"
    cmd = (root / f"proc/{after['nvlsm']}/cmdline").read_text().replace("\0", " ")
    assert cmd.startswith(f"{NVLSM.current}/sbin/nvlsm -F {NVLSM.current}/share/nvidia/nvlsm/nvlsm.conf"), cmd
    order = [s["action"] for s in journal(root)["steps"]]
    installs = [i for i, a in enumerate(order) if a == "install-companion"]
    assert len(installs) == 2 and order.index("unload-modules") < installs[0] and installs[-1] \
        < order.index("load-modules") < order.index("start-nvlsm") < order.index("start-fabricmanager"), order
    # the stop before the unload took NVLSM down with the fabric manager: one of each runs now
    assert sum(1 for p in (root / "proc").glob("*/comm") if p.read_text().strip() == "nvlsm") == 1


def test_nvlsm_waits_for_ib_umad_at_a_first_load(tmp_path, b200_packages):
    """ib_umad (the InfiniBand MAD interface NVLSM opens) is not loaded and no driver runs — a boot, where the
    InfiniBand stack comes up beside driverd: there is nothing to protect, so the plan loads and its start-nvlsm
    waits for the modules (bounded), as NVIDIA's driver container does."""
    root = _b200(tmp_path, b200_packages, ib_umad=False)
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    steps = json.loads(r.stdout)["steps"]
    nvlsm = next(s for s in steps if s["action"] == "start-nvlsm")
    assert "not loaded yet: ib_umad; it waits up to 300 s for them" in nvlsm["reason"], nvlsm
    assert nvlsm["params"] == {"after_modules": ["mlx5_core", "ib_core", "ib_umad"], "wait_s": 300}
    actions = [s["action"] for s in steps]
    assert actions.index("load-modules") < actions.index("start-nvlsm") < actions.index("start-fabricmanager")


def test_nvlsm_without_ib_umad_is_blocked_while_a_driver_runs(tmp_path, b200_packages):
    """The same with a driver loaded (here by hand, after ib_umad went away): replacing or restarting a working
    driver whose fabric cannot come up helps nobody, and the module does not appear by itself on a running host.
    The plan is BLOCKED before anything changes, naming the module and how it is loaded."""
    root = _b200(tmp_path, b200_packages)
    assert drv(root, "load").returncode == 0
    assert drv(root, "unload").returncode == 0
    k = kernel_of(root)
    k.unload("ib_umad")
    k.load("nvidia")
    r = drv(root, "plan")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "NVLSM cannot start: ib_umad is not loaded" in r.stdout and "modprobe ib_umad" in r.stdout, r.stdout
    assert "the driver that runs is left as it is" in r.stdout
    assert drv(root, "apply").returncode == 3 and kernel_of(root).is_loaded("nvidia")


@pytest.fixture(scope="module")
def nscq_packages(tmp_path_factory):
    out = tmp_path_factory.mktemp("nscq-pkgs")
    comp = make_companion_packages(out, ("535.261.03", "550.127.05"), components=("fabricmanager", "nscq"))
    return comp


def _hgx(tmp_path, packages, comp, *, nscq_in_repo: bool):
    """An HGX H100 host (2 GPUs, one NVSwitch) running 535 with driverd's 535 fabric manager; the 550 kernel
    package and fabric manager (and NSCQ) in the repository, companions.fetch on."""
    from driverd.repo.index import write_index
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(packages["new"], repo)
    shutil.copy(comp[("fabricmanager", "550.127.05")], repo)
    if nscq_in_repo:
        shutil.copy(comp[("nscq", "550.127.05")], repo)
    write_index(repo)
    root = make_host(tmp_path / "root", dgx_spec(gpus=2, nvswitches=1, nouveau=False))
    install(Root(root), packages["old"], Runner())
    ci.install(Root(root), comp[("fabricmanager", "535.261.03")], places=FM, driver="535.261.03")
    _config(root, '[driver]\nversion = "535.261.03"\nflavor = "open"\n[runtime]\nrestart = "none"\n')
    assert drv(root, "load").returncode == 0
    _config(root, f'[driver]\nversion = "550.127.05"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n'
                  '[companions]\nfetch = true\n[runtime]\nrestart = "none"\n')
    return root


def test_nscq_is_switched_with_the_driver_and_the_loader_finds_it(tmp_path, packages, nscq_packages):
    """Before: NSCQ was never installed (nvidia-smi and DCGM of the new driver could not read the switches). Now
    its 550 library is unpacked into its companion tree with the driver and named in a loader configuration of its
    own, as driverd's user-space is: the loader's cache maps NVIDIA's soname to it."""
    from tests.packages import usfake
    usfake.require_ldconfig()
    root = _hgx(tmp_path, packages, nscq_packages, nscq_in_repo=True)
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    comps = [s["params"]["component"] for s in p["steps"] if s["action"] == "install-companion"]
    assert comps == ["fabricmanager", "nscq"], p["steps"]
    assert not [w for w in p["warnings"] if "NSCQ" in w], p["warnings"]
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert current(Root(root), NSCQ).version == "550.127.05"
    conf = root / "etc/ld.so.conf.d/00-driverd-nvidia-nscq.conf"
    assert conf.read_text().splitlines()[-1] == f"{NSCQ.current}/lib"
    cache = subprocess.run(["ldconfig", "-r", str(root), "-p"], capture_output=True, text=True, timeout=60).stdout
    assert f"libnvidia-nscq.so.2 (libc6,x86-64) => {NSCQ.current}/lib/libnvidia-nscq.so.2" in cache, cache
    assert (root / NSCQ.current.lstrip("/") / "lib/libnvidia-nscq.so.550.127.05").is_file()


def test_no_nscq_of_the_version_is_a_warning_never_a_block(tmp_path, packages, nscq_packages):
    root = _hgx(tmp_path, packages, nscq_packages, nscq_in_repo=False)
    r = drv(root, "plan", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    p = json.loads(r.stdout)
    assert p["verdict"] == "steps" and not p["blocked_by"]
    assert "nscq" not in [s["params"].get("component") for s in p["steps"] if s["action"] == "install-companion"]
    w = [w for w in p["warnings"] if w.startswith("no NSCQ of driver 550.127.05 is available")]
    assert w and "a warning, not a block" in w[0] and "libnvidia_nscq-linux-<arch>-550.127.05" in w[0], p["warnings"]
    r = drv(root, "apply")
    assert r.returncode == 0, r.stdout + r.stderr
    assert current(Root(root), NSCQ) is None and not (root / "etc/ld.so.conf.d/00-driverd-nvidia-nscq.conf").exists()
