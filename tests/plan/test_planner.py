import pytest

from driverd.errors import UsageError
from driverd.host import collect
from driverd.plan import Desired, plan
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Pci, Proc, h100, nvidia_version_line, write_host

NVSW = Pci("0000:05:00.0", "0x10de", "0x22a3", "0x068000")
MLX = Pci("0000:0c:00.0", "0x15b3", "0x101d", "0x020700", "mlx5_core")


def facts(tmp_path, **kw):
    write_host(tmp_path, HostSpec(**kw))
    return collect(Root(tmp_path), nvml=False)


def actions(p):
    return [s.action for s in p.steps]


def loaded(version="570.195.03", flavor="open", refs=0):
    mods = [Module("nvidia", 5000000, refs, ("nvidia_modeset", "nvidia_uvm"), version=version),
            Module("nvidia_uvm", 100000, 0), Module("nvidia_modeset", 100000, 0)]
    # driverd installed it (on disk in its own directory): a loaded driver found nowhere on disk is the host's
    return dict(modules=mods, nvidia_version_text=nvidia_version_line(version, flavor),
                files={"/lib/modules/6.1.0-47-cloud-amd64/updates/driverd/nvidia.ko": "\x7fELF"})


def test_no_gpu_nothing_to_do(tmp_path):
    p = plan(facts(tmp_path), Desired("570.195.03"))
    assert p.nothing_to_do and p.flavor is None and p.steps == ()


def test_bare_host_full_provisioning_in_order(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0"), NVSW, MLX],
              files={"/etc/containerd/config.toml": 'version = 2\n', "/usr/bin/containerd": ""})
    p = plan(f, Desired("570.195.03"))
    assert actions(p) == ["blacklist-nouveau", "fetch-package", "install-package", "load-modules",
                          "start-persistenced", "start-fabricmanager", "configure-runtime", "validate"]
    load = p.steps[actions(p).index("load-modules")]
    # open modules on kernel 6.1 (>= 5.12): GPUDirect RDMA goes through DMA-BUF, no nvidia-peermem
    # (tests/plan/test_peermem.py has the MLNX_OFED / inbox / proprietary cases)
    # nothing needs nvidia-modeset here: no display GPU, nothing loaded before, not configured
    assert load.params["modules"] == ["nvidia", "nvidia_uvm"]
    assert "not needed" in load.params["why"]["nvidia_modeset"]
    assert "DMA-BUF" in load.params["why"]["nvidia_peermem"]
    assert not p.blocked_by and not p.reboot_required
    assert all(s.reason for s in p.steps)


def test_satisfied_host_has_no_steps(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0", "nvidia")],
              modprobe_d={"/etc/modprobe.d/nv.conf": "blacklist nouveau\noptions nouveau modeset=0\n"},
              procs=[Proc(812, "nvidia-persistenced")], **loaded())
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert p.nothing_to_do, actions(p)


def test_upgrade_replaces_loaded_driver(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0", "nvidia")], procs=[Proc(812, "nvidia-persistenced")],
              modprobe_d={"/etc/modprobe.d/nv.conf": "blacklist nouveau\noptions nouveau modeset=0\n"},
              **loaded("550.127.05", "proprietary"))
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert actions(p) == ["fetch-package", "install-package", "stop-gpu-daemons", "unload-modules",
                          "load-modules", "start-persistenced", "validate"]


def test_no_unload_support_means_reboot(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0", "nvidia")], module_unload=False, **loaded("550.127.05", "open"))
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert p.reboot_required and "cannot unload" in p.reboot_reasons[0]
    assert "unload-modules" not in actions(p) and "load-modules" not in actions(p)
    assert "install-package" in actions(p)


def test_signature_enforcement_blocks_only_when_the_kernel_would_refuse(tmp_path):
    from driverd.build.signers import ModuleVerdict, SignerVerdict
    f = facts(tmp_path, pci=[h100("0000:1b:00.0")], sig_enforce=True)
    assert not plan(f, Desired("570.195.03")).blocked_by          # nobody looked at the package: not blocked
    ok = SignerVerdict("accepted", "nvidia: signed by 'k' serial 01…; found in .machine", True, False)
    p = plan(f, Desired("570.195.03"), ok)
    assert not p.blocked_by and p.signatures["status"] == "accepted"
    no = SignerVerdict("refused", "nvidia: signed by 'other' serial 02…; not found in any trusted keyring: the load "
                       "would fail with 'Key was rejected by service'", True, True,
                       modules=(ModuleVerdict("nvidia", "untrusted", "..."),),
                       enrol="enrol 'other' as a MOK: mokutil --import other.der, reboot and confirm in MokManager")
    p = plan(f, Desired("570.195.03"), no)
    assert p.blocked_by and "signatures" in p.blocked_by[0] and "'other'" in p.blocked_by[0]
    assert "mokutil --import other.der" in p.blocked_by[0]


def test_gpu_in_use_blocks_unload_with_names(tmp_path):
    cg = "0::/kubepods.slice/kubepods-pod0a1b2c3d_1111_2222_3333_444455556666.slice/cri-containerd-" + "ab" * 32 + ".scope"
    f = facts(tmp_path, pci=[h100("0000:1b:00.0", "nvidia")], procs=[Proc(4242, "python3", ("/dev/nvidia0",), cg)],
              **loaded("550.127.05", "open", refs=1))
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert any("pid 4242 (python3, pod 0a1b2c3d-1111-2222-3333-444455556666)" in b for b in p.blocked_by)
    p2 = plan(f, Desired("570.195.03", runtimes=("none",), unload_policy="terminate"))
    assert not p2.blocked_by


def test_gpu_daemons_holding_the_gpu_do_not_block_the_upgrade_that_stops_them(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0", "nvidia")],
              procs=[Proc(812, "nvidia-persistenced", ("/dev/nvidiactl", "/dev/nvidia0")),
                     Proc(4242, "python3", ("/dev/nvidia0",))],
              **loaded("550.127.05", "open", refs=2))
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert len(p.blocked_by) == 1 and "pid 4242" in p.blocked_by[0] and "812" not in p.blocked_by[0]
    f = facts(tmp_path / "2", pci=[h100("0000:1b:00.0", "nvidia")],
              procs=[Proc(812, "nvidia-persistenced", ("/dev/nvidiactl", "/dev/nvidia0"))],
              **loaded("550.127.05", "open", refs=1))
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert not p.blocked_by and actions(p)[1:5] == ["fetch-package", "install-package", "stop-gpu-daemons",
                                                    "unload-modules"]


def test_nouveau_in_use_needs_reboot(tmp_path):
    f = facts(tmp_path, pci=[Pci("0000:01:00.0", "0x10de", "0x1eb8", "0x030200", "nouveau")],
              modules=[Module("nouveau", 2000000, 1, (), "")])
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert p.reboot_required and "nouveau" in p.reboot_reasons[0]
    assert "unload-nouveau" not in actions(p)
    f2 = facts(tmp_path / "b", pci=[Pci("0000:01:00.0", "0x10de", "0x1eb8", "0x030200", "nouveau")],
               modules=[Module("nouveau", 2000000, 0, (), "")])
    assert "unload-nouveau" in actions(plan(f2, Desired("570.195.03", runtimes=("none",))))


def test_module_parameters_flow_into_load(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0")])
    p = plan(f, Desired("570.195.03", module_parameters={"nvidia": {"NVreg_EnableGpuFirmware": "1"},
                                                         "nvidia_drm": {"modeset": "1"}}, runtimes=("none",)))
    load = next(s for s in p.steps if s.action == "load-modules")
    assert load.params["parameters"] == {"nvidia": {"NVreg_EnableGpuFirmware": "1"}}


def test_missing_version_is_usage_error(tmp_path):
    with pytest.raises(UsageError):
        plan(facts(tmp_path, pci=[h100("0000:1b:00.0")]), Desired(None))


def test_plan_is_pure(tmp_path):
    f = facts(tmp_path, pci=[h100("0000:1b:00.0")])
    assert plan(f, Desired("570.195.03")) == plan(f, Desired("570.195.03"))


def _decide(**kw):
    from driverd.plan.planner import decide_modules
    d = Desired("570.195.03", load_drm=kw.pop("drm", None), load_modeset=kw.pop("modeset", None))
    return decide_modules(d, frozenset(kw.pop("running", ())), tuple(kw.pop("display", ())), 0, None, "open",
                          "6.1.0-47-cloud-amd64")


def test_module_set_modeset_only_where_something_needs_it():
    assert _decide().modules == ["nvidia", "nvidia_uvm"]
    shown = _decide(display=["0000:01:00.0"])
    assert shown.modules == ["nvidia", "nvidia_uvm", "nvidia_modeset"]
    assert "0000:01:00.0 is a display controller" in shown.reasons["nvidia_modeset"]
    assert _decide(running=["nvidia", "nvidia_uvm", "nvidia_modeset"]).modules[-1] == "nvidia_modeset"
    assert _decide(modeset=True).modules == ["nvidia", "nvidia_uvm", "nvidia_modeset"]
    drm = _decide(drm=True, modeset=False)
    assert drm.modules == ["nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm"]
    assert any("load_modeset = false is overridden" in w for w in drm.warnings)
    assert _decide(display=["0000:01:00.0"], modeset=False).modules == ["nvidia", "nvidia_uvm"]


def test_display_gpu_by_pci_class(tmp_path):
    f = facts(tmp_path, pci=[Pci("0000:01:00.0", "0x10de", "0x2684", "0x030000")])      # an RTX 4090, VGA class
    p = plan(f, Desired("570.195.03", runtimes=("none",)))
    assert p.modules == ("nvidia", "nvidia_uvm", "nvidia_modeset")
