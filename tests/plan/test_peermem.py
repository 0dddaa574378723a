"""GPUDirect RDMA decided the way NVIDIA documents it: nvidia-peermem only where the kernel can load it
(MLNX_OFED's ib_core with ib_register_peer_memory_client) and it is needed (not with the open modules
on kernel >= 5.12, which use DMA-BUF); an upgrade loads the NVIDIA modules that were running."""
import pytest

from driverd.host import collect
from driverd.host.rdma import read_rdma
from driverd.plan import Desired, plan
from driverd.plan.peermem import decide_peermem
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Pci, h100, nvidia_version_line, write_host

MLX = Pci("0000:0c:00.0", "0x15b3", "0x101d", "0x020700", "mlx5_core")
NEW = "6.1.0-47-cloud-amd64"           # >= 5.12: DMA-BUF
OLD = "5.10.0-28-amd64"                # <  5.12
OFED_INFO = "#!/bin/bash\nif [ \"X$1\" == \"X-s\" ]; then echo MLNX_OFED_LINUX-24.10-1.1.4.0:; exit; fi\n"
KALLSYMS_OFED = ("ffffffffc0a00000 T ib_umem_get\t[ib_core]\n"
                 "ffffffffc0a01000 T ib_register_peer_memory_client\t[ib_core]\n")
KALLSYMS_INBOX = "ffffffffc0a00000 T ib_umem_get\t[ib_core]\nffffffffc0a02000 T ib_umem_dmabuf_get\t[ib_core]\n"


def rdma_host(tmp_path, *, ofed: bool, release: str = NEW, loaded_ib_core: bool = False, nic: bool = True,
              running: str | None = None, extra_modules=(), stale_ofed_info: bool = False):
    files, mods = {}, []
    if ofed:
        path = "updates/dkms/ib_core.ko"
        files["/usr/bin/ofed_info"] = OFED_INFO
    else:
        path = "kernel/drivers/infiniband/core/ib_core.ko.xz"
        if stale_ofed_info:
            files["/usr/bin/ofed_info"] = OFED_INFO
    files[f"/lib/modules/{release}/{path}"] = "\x7fELF"
    files[f"/lib/modules/{release}/modules.dep"] = (f"{path}:\nkernel/drivers/net/ethernet/mellanox/mlx5/core/"
                                                    f"mlx5_core.ko.xz: {path}\n")
    if loaded_ib_core:
        mods.append(Module("ib_core", 450000, 4, ("mlx5_ib",), ""))
        files["/proc/kallsyms"] = KALLSYMS_OFED if ofed else KALLSYMS_INBOX
    kw = {}
    if running:
        version, flavor = running
        mods += [Module("nvidia", 5000000, 0, ("nvidia_modeset", "nvidia_uvm"), version=version),
                 Module("nvidia_uvm", 100000, 0), Module("nvidia_modeset", 100000, 0)]
        mods += [Module(m, 100000, 0) for m in extra_modules]
        kw["nvidia_version_text"] = nvidia_version_line(version, flavor)
        # the running driver is driverd's own install (a loaded driver found nowhere on disk is the host's)
        files[f"/lib/modules/{release}/updates/driverd/nvidia.ko"] = "\x7fELF"
    write_host(tmp_path, HostSpec(release=release, pci=[h100("0000:1b:00.0", "nvidia" if running else None)]
                                  + ([MLX] if nic else []), files=files,
                                  modules=mods or [Module("ext4", 1000000, 1, (), "")], **kw))
    return collect(Root(tmp_path), nvml=False)


def load_step(p):
    return next(s for s in p.steps if s.action == "load-modules")


# (MLNX_OFED?, kernel, version -> flavour, peermem loaded?, words in the reason)
CASES = [
    (False, NEW, "550.163.01", "proprietary", False, "inbox"),         # inbox ib_core: the load would fail
    (False, NEW, "570.211.01", "open", False, "DMA-BUF"),              # open on >= 5.12: DMA-BUF
    (True, NEW, "550.163.01", "proprietary", True, "MLNX_OFED_LINUX-24.10-1.1.4.0"),
    (True, NEW, "570.211.01", "open", False, "DMA-BUF"),               # OFED there, still DMA-BUF is the path
    (True, OLD, "570.211.01", "open", True, "peer-memory API"),        # open on < 5.12: peermem
    (False, OLD, "570.211.01", "open", False, "inbox"),                # no DMA-BUF, no OFED: unavailable
]


@pytest.mark.parametrize("ofed,release,version,flavor,loads,words", CASES)
def test_peermem_only_where_it_can_load_and_is_needed(tmp_path, ofed, release, version, flavor, loads, words):
    f = rdma_host(tmp_path, ofed=ofed, release=release)
    p = plan(f, Desired(version, runtimes=("none",)))
    assert p.flavor == flavor and not p.blocked_by
    step = load_step(p)
    assert ("nvidia_peermem" in step.params["modules"]) == loads
    why = step.params["why"]["nvidia_peermem"]
    assert words in why and why in step.reason
    if not loads and not ofed:
        assert any("GPUDirect RDMA is unavailable" in w for w in p.warnings) == (flavor == "proprietary"
                                                                                   or release == OLD)


@pytest.mark.parametrize("ofed", [False, True])
def test_explicit_flavour_changes_the_decision(tmp_path, ofed):
    f = rdma_host(tmp_path, ofed=ofed)
    p = plan(f, Desired("570.211.01", flavor="proprietary", runtimes=("none",)))
    assert ("nvidia_peermem" in load_step(p).params["modules"]) == ofed


def test_loaded_inbox_ib_core_is_judged_by_kallsyms_even_with_a_stale_ofed_info(tmp_path):
    f = rdma_host(tmp_path, ofed=False, loaded_ib_core=True, stale_ofed_info=True)
    r = f.rdma
    assert r.ib_core_loaded and r.peer_memory_symbol is False and r.peer_memory_api is False
    assert "kallsyms" in r.evidence and r.ofed_version == "MLNX_OFED_LINUX-24.10-1.1.4.0"
    p = plan(f, Desired("550.163.01", runtimes=("none",)))
    assert "nvidia_peermem" not in load_step(p).params["modules"]


def test_loaded_ofed_ib_core_exports_the_symbol(tmp_path):
    f = rdma_host(tmp_path, ofed=True, loaded_ib_core=True)
    assert f.rdma.peer_memory_symbol is True and f.rdma.peer_memory_api is True
    assert f.rdma.ib_core_source == "mlnx-ofed" and f.rdma.ib_core_path.endswith("updates/dkms/ib_core.ko")


def test_load_peermem_true_on_inbox_blocks_the_plan(tmp_path):
    f = rdma_host(tmp_path, ofed=False)
    p = plan(f, Desired("550.163.01", load_peermem="true", runtimes=("none",)))
    assert p.blocked_by and "Unknown symbol" in p.blocked_by[0] and "MLNX_OFED" in p.blocked_by[0]
    assert "nvidia_peermem" not in load_step(p).params["modules"]


def test_load_peermem_true_with_ofed_and_false_anywhere(tmp_path):
    f = rdma_host(tmp_path, ofed=True)
    assert "nvidia_peermem" in load_step(plan(f, Desired("570.211.01", load_peermem="true", runtimes=("none",)))
                                         ).params["modules"]
    assert "nvidia_peermem" not in load_step(plan(f, Desired("550.163.01", load_peermem="false",
                                                             runtimes=("none",)))).params["modules"]


def test_no_mellanox_nic_no_peermem_and_no_rdma_facts(tmp_path):
    f = rdma_host(tmp_path, ofed=True, nic=False)
    assert f.rdma is None
    step = load_step(plan(f, Desired("550.163.01", runtimes=("none",))))
    assert "nvidia_peermem" not in step.params["modules"] and "no Mellanox NIC" in step.params["why"]["nvidia_peermem"]


def test_upgrade_keeps_the_running_set_drm_and_peermem(tmp_path):
    f = rdma_host(tmp_path, ofed=True, running=("550.127.05", "proprietary"),
                  extra_modules=("nvidia_drm", "nvidia_peermem"))
    p = plan(f, Desired("550.163.01", runtimes=("none",)))
    step = load_step(p)
    assert step.params["modules"] == ["nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem"]
    assert "was loaded with the running driver" in step.params["why"]["nvidia_drm"]
    assert "unload-modules" in [s.action for s in p.steps]
    # the configuration says otherwise: load_drm = false wins
    p2 = plan(f, Desired("550.163.01", load_drm=False, runtimes=("none",)))
    assert "nvidia_drm" not in load_step(p2).params["modules"]


def test_modules_outside_the_package_are_named_when_they_were_running(tmp_path):
    f = rdma_host(tmp_path, ofed=False, nic=False, running=("550.127.05", "proprietary"), extra_modules=("nvidia_fs",))
    p = plan(f, Desired("550.163.01", runtimes=("none",)))
    assert any("nvidia_fs is loaded" in w for w in p.warnings)


def test_decision_function_table():
    class R:
        def __init__(self, api):
            self.peer_memory_api, self.evidence, self.ofed_version = api, "evidence", None
    assert decide_peermem("auto", 0, None, "open", NEW).load is False
    assert decide_peermem("auto", 1, R(True), "proprietary", NEW).load is True
    assert decide_peermem("auto", 1, R(True), "open", NEW).load is False
    assert decide_peermem("auto", 1, R(None), "proprietary", NEW).warning
    assert decide_peermem("auto", 1, R(False), "proprietary", NEW, was_loaded=True).load is False
    assert decide_peermem("auto", 1, R(None), "open", NEW, was_loaded=True).load is True
    assert decide_peermem("true", 1, R(False), "open", NEW).blocked


def test_rdma_facts_without_modules_dep_scan_the_tree(tmp_path):
    rel = NEW
    (tmp_path / f"lib/modules/{rel}/extra/mlnx-ofa_kernel/drivers/infiniband/core").mkdir(parents=True)
    (tmp_path / f"lib/modules/{rel}/extra/mlnx-ofa_kernel/drivers/infiniband/core/ib_core.ko").write_bytes(b"x")
    r = read_rdma(Root(tmp_path), rel, {})
    assert r.ib_core_source == "mlnx-ofed" and r.peer_memory_api is True
    empty = read_rdma(Root(tmp_path / "nothing"), rel, {})
    assert empty.ib_core_source == "absent" and empty.peer_memory_api is None


# -- the same rules on the plan-less paths (driverd load / reload), through the real command line ----

from tests.apply.conftest import drv  # noqa: E402
from tests.kmod.conftest import host, kernel_of, packages  # noqa: E402,F401  (fixtures)


def _config(root, text: str) -> None:
    p = root / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_reload_loads_back_nvidia_drm_that_was_running(host, packages):
    _config(host, "[modules]\nload_drm = true\n")
    assert drv(host, "load").returncode == 0
    assert kernel_of(host).is_loaded("nvidia_drm")
    _config(host, "")                                   # unset: keep what runs
    r = drv(host, "reload", "--package", str(packages["new"]))
    assert r.returncode == 0, r.stderr
    assert kernel_of(host).is_loaded("nvidia_drm")
    _config(host, "[modules]\nload_drm = false\n")      # the configuration says otherwise
    r = drv(host, "reload", "--package", str(packages["old"]))
    assert r.returncode == 0, r.stderr
    assert not kernel_of(host).is_loaded("nvidia_drm")


def test_load_never_loads_peermem_on_an_inbox_ib_core(host):
    """The scenario host has a Mellanox NIC and no MLNX_OFED: `driverd load` with the (open) package
    on kernel 6.1 leaves nvidia-peermem out, as the plan does."""
    assert drv(host, "load").returncode == 0
    assert kernel_of(host).is_loaded("nvidia") and not kernel_of(host).is_loaded("nvidia_peermem")
