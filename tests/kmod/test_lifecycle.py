"""Bad inputs through the simulated kernel and the real kmod tools; the kernel's own words in errors."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from driverd.errors import ConfigError, ModuleError
from driverd.kmod import load as ld, unload as ul
from driverd.kmod.kernel import RealKernel, select_kernel
from driverd.root import Root
from driverd.runner import Runner
from tests.conftest import require_binary
from tests.kmod.conftest import kernel_of

CORE = ["nvidia", "nvidia_uvm", "nvidia_modeset"]


def test_load_validate_unload_order_from_holders(host):
    k = kernel_of(host)
    ld.load(k, CORE + ["nvidia_drm"], {}, ("535.261.03", "open"))
    v = ld.validate(k, "535.261.03", "open")
    assert v.ok and v.gpus_visible == v.gpus_expected and len(v.gpus_visible) == 2
    assert (host / "dev/nvidia-uvm").exists() and (host / "dev/nvidiactl").exists()
    rep = ul.unload(k)
    # nvidia_drm holds nvidia_modeset which holds nvidia: the graph, not a list, gives the order.
    assert rep.order.index("nvidia_drm") < rep.order.index("nvidia_modeset") < rep.order.index("nvidia")
    assert not any(m.startswith("nvidia") for m in k.modules())


def test_in_use_names_pid_command_and_pod(host):
    k = kernel_of(host)
    ld.load(k, CORE, {}, ("535.261.03", "open"))
    cid = "b" * 64
    (host / f"run/containerd/io.containerd.runtime.v2.task/k8s.io/{cid}").mkdir(parents=True)
    (host / f"run/containerd/io.containerd.runtime.v2.task/k8s.io/{cid}/config.json").write_text(
        '{"annotations": {"io.kubernetes.cri.sandbox-name": "trainer-0", "io.kubernetes.cri.sandbox-namespace": "ml",'
        ' "io.kubernetes.cri.container-name": "pytorch"}}')
    pid = k.spawn("python3", ["/dev/nvidia0", "/dev/nvidia-uvm"], cmdline="python3 train.py",
                  cgroup=f"0::/kubepods.slice/kubepods-podaaaaaaaa_bbbb_cccc_dddd_eeeeeeeeeeee.slice/cri-containerd-{cid}.scope",
                  ignores_sigterm=True)
    with pytest.raises(ModuleError) as e:
        ul.unload(k)
    msg = e.value.one_line()
    assert f"pid {pid}" in msg and "python3 train.py" in msg and "pod ml/trainer-0" in msg and "pytorch" in msg
    assert k.is_loaded("nvidia")                       # nothing was unloaded
    with pytest.raises(ModuleError, match="in use"):   # the kernel itself refuses too
        k.unload("nvidia_uvm")
    rep = ul.unload(k, "terminate", grace=0.2)         # SIGTERM ignored -> SIGKILL
    assert rep.terminated and not k.alive(pid) and not k.is_loaded("nvidia")


def test_cuda_library_mapping_is_a_holder(host):
    k = kernel_of(host)
    ld.load(k, CORE, {}, ("535.261.03", "open"))
    pid = k.spawn("nvidia-smi", [], maps=["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.535.261.03"])
    with pytest.raises(ModuleError, match=f"pid {pid}.*libnvidia-ml"):
        ul.unload(k)


def _kernel_said(e) -> str:
    """The kernel's lines a failed insert quotes: a list beside the one-line error, not inside it."""
    assert " | " not in e.one_line() and "kernel log:" not in e.one_line()
    return "\n".join(e.details["kernel_log"])


def test_unknown_parameter_is_an_error_not_ignored(host):
    k = kernel_of(host)
    with pytest.raises(ConfigError, match="unknown parameter NVreg_Bogus for module nvidia") as e:
        ld.load(k, CORE, {"nvidia": {"NVreg_Bogus": "1"}}, ("535.261.03", "open"))
    assert "NVreg_EnableGpuFirmware" in e.value.cause
    assert not k.is_loaded("nvidia")
    # The simulated kernel, like the real one, only logs and ignores it when asked directly:
    k.load("nvidia", {"NVreg_Bogus": "1"})
    assert any("unknown parameter 'NVreg_Bogus' ignored" in ln for ln in k.log_since(0))


def test_bad_parameter_value_is_refused_by_type_before_the_kernel_sees_it(host):
    k = kernel_of(host)
    with pytest.raises(ConfigError) as e:
        ld.load(k, CORE, {"nvidia_uvm": {"uvm_perf_prefetch_enable": "maybe"}}, ("535.261.03", "open"))
    assert "uvm_perf_prefetch_enable='maybe' (uint wants an unsigned integer)" in e.value.message
    assert not k.is_loaded("nvidia")
    # The kernel itself refuses it the same way (EINVAL, with its own words in the log).
    with pytest.raises(ModuleError) as e:
        k.load("nvidia_uvm", {"uvm_perf_prefetch_enable": "maybe"})
    assert "Invalid argument" in e.value.message and "invalid for parameter" in _kernel_said(e.value)


@pytest.mark.parametrize("ptype,value,ok", [
    ("int", "-5", True), ("int", "0x1f", True), ("int", "2147483648", False), ("uint", "-1", False),
    ("uint", "4294967295", True), ("byte", "255", True), ("byte", "256", False), ("ulong", "18446744073709551615", True),
    ("bool", "Y", True), ("bool", "on", True), ("bool", "off", True), ("bool", "maybe", False), ("invbool", "0", True),
    ("charp", "anything at all", True), ("charp", "x" * 1025, False), ("array of int", "1,2,3", True),
    ("array of int", "1,x", False), ("hexint", "0xff", True), ("short", "-32769", False), (None, "whatever", True)])
def test_parameter_values_are_judged_by_the_kernels_rules(ptype, value, ok):
    assert (ld.value_problem(ptype, value) is None) == ok


def test_wrong_vermagic_and_unsigned_under_enforcement(host, tmp_path):
    from driverd.sim.fakemod import FakeModule, default_vermagic, write_module
    k = kernel_of(host)
    d = host / f"lib/modules/{k.release}/updates/driverd"
    write_module(FakeModule("nvidia", version="535.261.03", vermagic=default_vermagic("6.1.0-56-cloud-amd64"),
                            exports=("nvUvmInterfaceRegisterGpu",)), d)
    with pytest.raises(ModuleError) as e:
        k.load("nvidia")
    assert "Exec format error" in e.value.message and "version magic" in _kernel_said(e.value)
    # Signature enforcement: a correct-vermagic but unsigned module is rejected.
    write_module(FakeModule("nvidia", version="535.261.03", vermagic=default_vermagic(k.release)), d)
    (host / "sys/module/module/parameters/sig_enforce").write_text("Y\n")
    with pytest.raises(ModuleError) as e:
        kernel_of(host).load("nvidia")
    assert "Key was rejected by service" in e.value.message and "unsigned module is rejected" in _kernel_said(e.value)


def test_missing_firmware_fails_load_and_firmware_path_fixes_it(host):
    k = kernel_of(host)
    fw = host / "lib/firmware/nvidia/535.261.03"
    moved = host / "var/lib/driverd/firmware/nvidia/535.261.03"
    moved.parent.mkdir(parents=True)
    shutil.move(str(fw), str(moved))
    with pytest.raises(ModuleError) as e:
        k.load("nvidia")
    assert "No such device" in e.value.message and "RmFetchGspRmImages" in _kernel_said(e.value)
    rep = ld.load(k, CORE, {}, ("535.261.03", "open"))   # driverd points firmware_class.path at it
    assert rep.firmware_path == "/var/lib/driverd/firmware" and k.is_loaded("nvidia")


def test_nouveau_bound_gpu_is_not_driven(tmp_path, packages):
    from driverd.install.modules import install
    from driverd.sim.scenario import dgx_spec, make_host
    from driverd.kmod import nouveau
    root = make_host(tmp_path / "r", dgx_spec(gpus=1, nvswitches=0, nic=False, nouveau=True, nouveau_in_use=True))
    install(Root(root), packages["old"], Runner())
    k = kernel_of(root)
    with pytest.raises(ModuleError) as e:
        k.load("nvidia")
    assert "already bound to nouveau" in _kernel_said(e.value)
    res = nouveau.unload(k)
    assert res.reboot_required and "in use" in res.reason and k.is_loaded("nouveau")
    assert nouveau.write_blacklist(Root(root)) and not nouveau.write_blacklist(Root(root))
    text = (root / "etc/modprobe.d/driverd-blacklist-nouveau.conf").read_text()
    assert "blacklist nouveau" in text and "options nouveau modeset=0" in text


def test_initramfs_carrying_nouveau_offers_regeneration(tmp_path):
    import gzip, io
    from driverd.kmod import nouveau
    def newc(names):
        out = io.BytesIO()
        for i, n in enumerate(names + ["TRAILER!!!"]):
            nb = n.encode() + b"\0"
            hdr = b"070701" + b"".join(b"%08X" % v for v in (i, 0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0, len(nb), 0))
            out.write(hdr + nb + b"\0" * ((-(110 + len(nb))) % 4))
        return out.getvalue()
    root = tmp_path / "r"
    (root / "boot").mkdir(parents=True)
    rel = "6.1.0-47-cloud-amd64"
    img = newc(["kernel/x86/microcode/GenuineIntel.bin"]) + gzip.compress(
        newc(["usr/lib/modules/6.1.0-47-cloud-amd64/kernel/drivers/gpu/drm/nouveau/nouveau.ko"]))
    (root / f"boot/initrd.img-{rel}").write_bytes(img)
    rep = nouveau.initramfs_report(Root(root), "debian", (), rel)
    assert rep["carries_nouveau"] and rep["regenerate"] == ["update-initramfs", "-u", "-k", rel]
    assert nouveau.regenerate_argv(Root(root), "rhel", ("fedora",), rel) == ["dracut", "-f", "--kver", rel]


@pytest.mark.real
def test_real_depmod_and_modprobe_agree_with_load_order(host):
    exe = require_binary("modprobe")
    k = kernel_of(host)
    mods = CORE + ["nvidia_drm", "nvidia_peermem"]
    order = ld.dependency_order(k, mods)
    for m in mods:
        res = subprocess.run([exe, "-d", str(host), "-S", k.release, "--show-depends", m], capture_output=True,
                             text=True, check=True)
        files = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("insmod")]
        names = [f.rsplit("/", 1)[-1].removesuffix(".ko").replace("-", "_") for f in files]
        assert names[-1] == m
        assert [n for n in order if n in names] == names, (m, names, order)   # same relative order
        assert all(f.startswith(str(host) + f"/lib/modules/{k.release}/updates/driverd/") for f in files)
        info = k.modinfo(m)   # real `modinfo` on the installed file
        assert info.version == "535.261.03"


@pytest.mark.real
def test_modinfo_tool_and_elf_reader_agree(host):
    from tests.kmodtools import kmod_modinfo
    k = kernel_of(host)
    path = str(k.root.real(k.module_file("nvidia")))
    a, b = kmod_modinfo([path])[os.path.realpath(path)], k.modinfo("nvidia")
    assert (a["version"], a["vermagic"], a["firmware"]) == ([b.version], [b.vermagic.strip()], list(b.firmware))
    assert {p.split(":")[0] for p in a["parm"]} == set(b.params)
    assert b.params["NVreg_EnableGpuFirmware"].type == "int"


def test_real_kernel_argv_and_refusals(host):
    runner = Runner(dry_run=True)
    captured = RealKernel(Root(host), Runner())          # a tree that is not this host: readable ...
    assert not captured.live
    with pytest.raises(ConfigError, match="not the live host"):
        captured.load("nvidia", {})                       # ... never changed
    with pytest.raises(ConfigError, match="not the live host"):
        captured.unload("nvidia")
    RealKernel(Root(host), runner).load("nvidia", {})    # in dry-run it is only recorded
    assert runner.history[-1].dry_run and "-d" in runner.history[-1].argv
    k = RealKernel(Root("/"), runner)
    assert k.load_argv("nvidia", {"NVreg_EnableGpuFirmware": "1"})[-2:] == ["nvidia", "NVreg_EnableGpuFirmware=1"]
    assert k.unload_argv("nvidia_uvm")[-1] == "nvidia_uvm"
    k.load("nvidia", {})                 # dry-run: recorded, not run
    assert runner.history[-1].dry_run and runner.history[-1].argv[-1] == "nvidia"
    with pytest.raises(ConfigError):
        select_kernel(Root("/"), runner, "sim")


def test_mig_layout_restored_across_reload(host):
    from driverd.kmod import mig
    from driverd.kmod.mig import GpuInstance, GpuMig, ComputeInstance
    from driverd.sim.services import SimMig
    k = kernel_of(host)
    ld.load(k, CORE, {}, ("535.261.03", "open"))
    g = GpuMig("0000:18:00.0", True, (GpuInstance(9, 0, 4, (ComputeInstance(0),)), GpuInstance(9, 4, 4)))
    SimMig(k).create(g)
    SimMig(k).create(GpuMig("0000:28:00.0", False))
    rec = mig.record(k)
    ul.unload(k)
    ld.load(k, CORE, {}, ("535.261.03", "open"))
    assert not [x for x in SimMig(k).read() if x.gpu_instances]      # the reload destroyed them
    res = mig.restore(k, rec)
    assert res.restored == ["0000:18:00.0"] and not res.must_reapply
    assert {x.pci_address: x for x in SimMig(k).read()}["0000:18:00.0"] == g
    # MIG mode off after the reload: an instruction, never silence.
    SimMig(k).create(GpuMig("0000:18:00.0", False))
    res = mig.restore(k, rec)
    assert res.must_reapply and "nvidia-mig-parted" in res.must_reapply[0]


class _AsReal:
    """The simulated kernel, named as the real one: validate() asks a live host's NVML only there."""
    name = "real"

    def __init__(self, kernel) -> None:
        self._k = kernel

    def __getattr__(self, attr):
        return getattr(self._k, attr)


@pytest.mark.parametrize("persistence", [True, False])
def test_a_live_validation_with_the_workload_check_starts_nvml_once(host, monkeypatch, persistence):
    """Issue 47: where the workload check runs, validate() takes what NVML says (every GPU, persistence) from
    the check's own NVML report instead of starting NVML again in a query process of its own (~65 ms of every
    validation, the container's fast path included). Stand-in NVIDIA libraries; the tree looks as this
    machine's /host mount does (its boot id, /proc/self)."""
    from driverd.host import nvml
    from tests import cudastandin
    k = kernel_of(host)
    ld.load(k, CORE, {}, ("535.261.03", "open"))
    (host / "proc/sys/kernel/random/boot_id").write_text(open("/proc/sys/kernel/random/boot_id").read())
    if not (host / "proc/self").is_symlink():
        (host / "proc/self").symlink_to("1")
    assert Root(host).is_live()
    gpus = sorted(os.listdir(host / "proc/driver/nvidia/gpus"))
    cudastandin.install(host, "535.261.03", gpus, persistence=persistence)

    def asked(*a, **kw):
        raise AssertionError("a second NVML query was started")
    monkeypatch.setattr(nvml, "read_nvml", asked)
    v = ld.validate(_AsReal(k), "535.261.03", "open", persistence=True, workload={"timeout_s": 60})
    assert v.workload["ok"] and [d["persistence_mode"] for d in v.workload["nvml"]["devices"]] == [persistence] * 2
    assert v.problems == ([] if persistence else
                          ["persistence mode is off on some GPUs although daemons.persistenced is on"])
    # without the workload check, the query of its own is what reads NVML
    with pytest.raises(AssertionError, match="second NVML query"):
        ld.validate(_AsReal(k), "535.261.03", "open", persistence=True)
