"""The host readers against the formats the kernel, NVIDIA's driver, kmod and os-release(5) really
produce, including the variants our own fixtures never wrote (see each test's source note)."""
from __future__ import annotations

import os
import subprocess

import pytest

from driverd.host import collect
from driverd.host.kernel import cmdline_args, cmdline_params, parse_lockdown
from driverd.driver.ident import parse_version_file as parse_nvidia_version
from driverd.host.modules import parse_proc_modules, read_module
from driverd.host.nouveau import parse_modprobe_conf, read_nouveau
from driverd.host.osrelease import parse_os_release, read_os
from driverd.runtime.containerd import containerd_handlers
from driverd.host.textfmt import kernel_int, kstrtobool
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Pci, h100, write_host
from tests.conftest import require_binary


# -- /proc/modules: kernel/module/procfs.c m_show() ------------------------------------------
def test_proc_modules_loading_and_unloading_rows_carry_state_marks_inside_the_taints():
    # module_flags(mod, buf, true): '(' taints ['-' going | '+' coming] ')', printed only if tainted
    text = ("nvidia 56381440 0 - Loading 0xffffffffc0400000 (POE+)\n"
            "nvidia_uvm 1519616 0 - Unloading 0x0000000000000000 (OE-)\n"
            "ext4 991232 1 - Live 0x0000000000000000\n")
    m = parse_proc_modules(text)
    assert m["nvidia"]["state"] == "Loading" and m["nvidia"]["taints"] == "POE"
    assert m["nvidia_uvm"]["state"] == "Unloading" and m["nvidia_uvm"]["taints"] == "OE"
    assert m["ext4"]["taints"] == "" and m["ext4"]["state"] == "Live"


def test_proc_modules_without_module_unload_and_permanent_and_negative_refcount():
    m = parse_proc_modules("video 65536 - - Live 0xffffffffc0e8e000\n"
                           "i2c_core 110592 3 [permanent],drm, Live 0xffffffffc0100000\n"
                           "dying 4096 -1 - Unloading 0xffffffffc0200000\n")
    assert m["video"]["refcount"] is None and m["video"]["used_by"] == ()
    assert m["i2c_core"]["permanent"] and m["i2c_core"]["used_by"] == ("drm",)
    assert m["dying"]["refcount"] == -1      # module_refcount() is printed with %i


def test_proc_modules_rejects_non_ascii_numbers_and_bad_names():
    m = parse_proc_modules("nvidia ²³ ² - Live 0x0 (O)\n../etc 1 0 - Live 0x0\n")
    assert m["nvidia"]["size"] is None and m["nvidia"]["refcount"] is None
    assert "../etc" not in m


def test_sysfs_initstate_and_taint_when_proc_modules_lacks_the_row(tmp_path):
    # kernel/module/main.c: initstate "live|coming|going", taint = flags without parentheses
    base = tmp_path / "sys/module/nvidia"
    (base / "holders").mkdir(parents=True)
    (base / "initstate").write_text("coming\n")
    (base / "taint").write_text("OE\n")
    (base / "refcnt").write_text("-1\n")
    (base / "version").write_text("535.261.03\n")
    mf = read_module(Root(tmp_path), "nvidia", None)
    assert (mf.state, mf.taints, mf.refcount, mf.version) == ("Loading", "OE", -1, "535.261.03")


# -- /proc/driver/nvidia/version: nv-procfs.c nv_procfs_read_version() ------------------------
@pytest.mark.parametrize("line,version,flavor", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024", "470.256.02", "proprietary"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  390.157  Wed Oct 12 09:19:07 UTC 2022", "390.157", "proprietary"),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module for GRID  535.183.06  Wed Jun 26 06:23:28 UTC 2024", "535.183.06", "proprietary"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.195.03  Release Build  (dvs-builder@U22-I3-AF03-09-1)  Fri Sep 12 2025", "570.195.03", "open"),
    ("NVRM version: NVIDIA UNIX ppc64le Kernel Module  525.147.05  Wed Oct 25 21:09:40 UTC 2023", "525.147.05", "proprietary"),
])
def test_nvidia_version_variants(line, version, flavor):
    text = line + "\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    assert parse_nvidia_version(text)[:2] == (version, flavor)


def test_nvidia_version_without_kernel_module_words_is_unknown():
    assert parse_nvidia_version("NVRM version: \x00\x01 12.34.56\n")[:2] == (None, None)


# -- PCI sysfs: drivers/pci/pci-sysfs.c -------------------------------------------------------
def _facts(tmp_path, **kw):
    return collect(Root(write_host(tmp_path, HostSpec(**kw))), nvml=False)


def test_vmd_domain_vfio_bound_gpu_and_other_display_function(tmp_path):
    f = _facts(tmp_path, pci=[h100("10000:e1:00.0", "nvidia", numa=1), h100("0000:3b:00.0", "vfio-pci"),
                              Pci("0000:5e:00.0", "0x10de", "0x2330", "0x038000")])
    gpus = {g.pci_address: g for g in f.gpus}
    assert set(gpus) == {"10000:e1:00.0", "0000:3b:00.0"}      # 0x0380 is not one nvidia.ko binds
    assert gpus["10000:e1:00.0"].numa_node == 1
    assert gpus["0000:3b:00.0"].bound_driver == "vfio-pci"
    assert any("0000:3b:00.0" in w and "vfio-pci" in w for w in f.warnings)
    assert any("0000:5e:00.0" in w and "0x0380" in w for w in f.warnings)


def test_numa_node_minus_one_is_none_and_class_must_be_six_hex_digits(tmp_path):
    f = _facts(tmp_path, pci=[h100("0000:01:00.0", numa=-1), Pci("0000:02:00.0", "0x10de", "0x2330", "0x0302")])
    assert [g.pci_address for g in f.gpus] == ["0000:01:00.0"] and f.gpus[0].numa_node is None
    assert any("0000:02:00.0" in w for w in f.warnings)


def test_gpu_information_without_uuid_line(tmp_path):
    # nv_procfs_read_gpu_info() omits "GPU UUID:" when RM has none
    info = "Model: \t\t NVIDIA H100\nIRQ:   \t\t 41\nBus Location: \t 0000:01:00.0\nDevice Minor: \t 0\n"
    f = _facts(tmp_path, pci=[h100("0000:01:00.0", "nvidia")],
               files={"/proc/driver/nvidia/gpus/0000:01:00.0/information": info})
    assert f.gpus[0].uuid is None and f.gpus[0].minor == 0


# -- signatures, lockdown, secure boot ---------------------------------------------------------
def test_module_sig_without_force_is_not_enforced(tmp_path):
    f = _facts(tmp_path, config={"CONFIG_MODULES": "y", "CONFIG_MODULE_SIG": "y", "CONFIG_MODULE_SIG_FORCE": "n"})
    assert not f.kernel.module_signature_enforced


@pytest.mark.parametrize("cmdline", ["ro module.sig_enforce", "ro module.sig_enforce=on", "ro module.sig-enforce=y"])
def test_sig_enforce_on_the_command_line_in_every_form_the_kernel_accepts(tmp_path, cmdline):
    f = _facts(tmp_path, cmdline=cmdline)
    assert f.kernel.module_signature_enforced
    assert any("command line" in s for s in f.kernel.signature_enforcement_sources)


def test_lockdown_file_present_but_empty_is_unknown_with_a_warning(tmp_path):
    f = _facts(tmp_path, lockdown="")
    assert f.kernel.lockdown is None and any("lockdown" in w for w in f.warnings)
    assert parse_lockdown("none integrity [confidentiality]\n") == "confidentiality"
    assert parse_lockdown("[bogus]") is None


def test_secure_boot_efivarfs_attribute_bytes(tmp_path):
    assert _facts(tmp_path / "a", secure_boot=True).kernel.secure_boot == "enabled"
    assert _facts(tmp_path / "b", secure_boot=False).kernel.secure_boot == "disabled"


# -- kernel command line: lib/cmdline.c next_arg() ---------------------------------------------
def test_cmdline_quotes_and_double_dash():
    args = cmdline_args('root=UUID=a "dyndbg=file x.c +p" acpi="a b" modprobe.blacklist=nouveau -- nouveau.modeset=1')
    assert ("dyndbg", "file x.c +p") in args and ("acpi", "a b") in args
    assert cmdline_params('a=1 a=2 flag')["a"] == "2" and cmdline_params("flag")["flag"] == ""
    assert "nouveau.modeset" not in dict(args)   # after `--` the words belong to init


def test_kstrtobool_and_kernel_int():
    assert [kstrtobool(x) for x in ("Y", "1", "on", "off", "N", "x", "")] == [True, True, True, False, False, None, None]
    assert kernel_int(" -1\n") == -1 and kernel_int("²") is None and kernel_int("1_0") is None
    assert kernel_int("9" * 5000) is None


# -- os-release(5) ------------------------------------------------------------------------------
def test_os_release_with_bom_crlf_comments_and_escapes(tmp_path):
    text = '\ufeffNAME="Ubuntu"\r\n# comment\r\nID=ubuntu\r\nID_LIKE="Debian"\r\nVERSION_ID="22.04"\r\nPRETTY_NAME="It\\"s \\$x"\r\n'
    vals, bad = parse_os_release(text)
    assert bad == [] and vals["ID"] == "ubuntu" and vals["VERSION_ID"] == "22.04"
    assert vals["PRETTY_NAME"] == 'It"s $x'
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/os-release").write_bytes(text.encode())
    (tmp_path / "etc").mkdir()
    os.symlink("../usr/lib/os-release", tmp_path / "etc/os-release")
    o = read_os(Root(tmp_path), [])
    assert (o.id, o.version_id, o.id_like, o.source) == ("ubuntu", "22.04", ("debian",), "/etc/os-release")


def test_dangling_etc_os_release_falls_back_to_usr_lib(tmp_path):
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/os-release").write_text("ID=rhel\nVERSION_ID=9.4\n")
    (tmp_path / "etc").mkdir()
    os.symlink("/nonexistent", tmp_path / "etc/os-release")
    o = read_os(Root(tmp_path), [])
    assert (o.id, o.source) == ("rhel", "/usr/lib/os-release")


# -- modprobe.d(5), as libkmod parses it ---------------------------------------------------------
TRICKY_CONF = ("blacklist nouveau # trailing words are ignored\n"
               "options nouveau modeset=0 # not a comment for kmod\n"
               "blacklist\tlbm-nouveau\n"
               "install nvidia-drm /sbin/modprobe --ignore-install nvidia-drm $CMDLINE_OPTS\n"
               "softdep nvidia pre: ecdh_generic\n"
               "options nvidia \\\n  NVreg_OpenRmEnableUnsupportedGpus=1\n")


def test_modprobe_conf_follows_kmod():
    cmds = parse_modprobe_conf(TRICKY_CONF)
    assert ["blacklist", "lbm_nouveau"] in cmds
    assert ["options", "nouveau", "modeset=0", "#", "not", "a", "comment", "for", "kmod"] in cmds
    assert ["options", "nvidia", "NVreg_OpenRmEnableUnsupportedGpus=1"] in cmds
    assert cmds[0][:2] == ["blacklist", "nouveau"]


@pytest.mark.real
def test_modprobe_conf_matches_real_modprobe_dump(tmp_path):
    modprobe = require_binary("modprobe")
    conf = tmp_path / "x.conf"
    conf.write_text(TRICKY_CONF)
    out = subprocess.run([modprobe, "-C", str(conf), "-c"], capture_output=True, text=True, timeout=60).stdout
    real = {tuple(ln.split()[:2]) for ln in out.splitlines() if ln.startswith(("blacklist ", "softdep "))}
    ours = {tuple(c[:2]) for c in parse_modprobe_conf(TRICKY_CONF) if c[0] in ("blacklist", "softdep")}
    assert ours <= real
    real_opts = {ln.split(None, 2)[1]: ln.split(None, 2)[2].split() for ln in out.splitlines()
                 if ln.startswith("options nouveau ") or ln.startswith("options nvidia ")}
    ours_opts = {c[1]: c[2:] for c in parse_modprobe_conf(TRICKY_CONF) if c[0] == "options"}
    assert real_opts == ours_opts


def test_blacklists_across_files_masking_and_install_true(tmp_path):
    spec = HostSpec(modprobe_d={
        "/etc/modprobe.d/nvidia-installer-disable-nouveau.conf": "blacklist nouveau\noptions nouveau modeset=0\n",
        "/lib/modprobe.d/blacklist-nvidia-nouveau.conf": "blacklist nouveau\n",
        "/usr/lib/modprobe.d/zz.conf": "install nouveau /bin/true\n",
        # same name as a /lib file: /etc hides it (kmod's directory priority)
        "/etc/modprobe.d/masked.conf": "",
        "/lib/modprobe.d/masked.conf": "options nouveau modeset=1\n",
    })
    root = write_host(tmp_path, spec)
    (tmp_path / "run/modprobe.d/dir.conf").mkdir(parents=True)   # a directory is skipped
    nv = read_nouveau(Root(root), [])
    assert nv.blacklisted and nv.modeset_disabled
    assert "/etc/modprobe.d/nvidia-installer-disable-nouveau.conf" in nv.blacklist_sources
    assert "/lib/modprobe.d/blacklist-nvidia-nouveau.conf" in nv.blacklist_sources
    assert any("install /bin/true" in s for s in nv.blacklist_sources)


def test_cmdline_blacklist_lists_and_repeats(tmp_path):
    root = write_host(tmp_path, HostSpec(cmdline="ro modprobe.blacklist=foo modprobe.blacklist=bar,nouveau"))
    nv = read_nouveau(Root(root), [])
    assert nv.blacklist_sources == ("kernel command line modprobe.blacklist=nouveau",)


# -- containerd config versions ------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    '[plugins.cri.containerd.runtimes.nvidia]\nruntime_type = "io.containerd.runc.v2"\n',             # v1 (no version)
    'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\nruntime_type = "x"\n',
    "version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.nvidia]\nruntime_type = 'x'\n",
])
def test_containerd_handlers_in_every_config_version(tmp_path, text):
    (tmp_path / "etc/containerd").mkdir(parents=True)
    (tmp_path / "etc/containerd/config.toml").write_text(text)
    assert containerd_handlers(Root(tmp_path), "/etc/containerd/config.toml")[0] == ["nvidia"]


def test_containerd_relative_and_nested_imports(tmp_path):
    d = tmp_path / "etc/containerd"
    (d / "conf.d").mkdir(parents=True)
    (d / "config.toml").write_text('version = 2\nimports = ["conf.d/*.toml"]\n')
    (d / "conf.d/10-a.toml").write_text('version = 2\nimports = ["/etc/containerd/more.toml"]\n'
                                        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kata]\n')
    (d / "more.toml").write_text('version = 2\nimports = ["/etc/containerd/config.toml"]\n'
                                 '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n')
    assert containerd_handlers(Root(tmp_path), "/etc/containerd/config.toml")[0] == ["kata", "nvidia"]


def test_proc_modules_state_reaches_facts(tmp_path):
    root = write_host(tmp_path, HostSpec(modules=[Module("nvidia", 100, 0, (), "OE", "535.261.03")]))
    (tmp_path / "proc/modules").write_text("nvidia 100 0 - Unloading 0xffffffffc0400000 (OE-)\n")
    f = collect(Root(root), nvml=False)
    assert f.driver.modules[0].state == "Unloading" and f.driver.modules[0].taints == "OE"
