"""Which GPU fabric a host has (driverd.host.fabric), from the simulated trees of each kind, and the VPD
format the switch-tray evidence is read in (driverd.host.vpd)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from driverd.host import collect, vpd
from driverd.host.facts import Facts
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Pci, vpd_image, write_host, write_modules
from driverd.sim.scenario import (B200, CX7, GB200, IB_CLASS, IMEX_MAJOR, cx7_vpd, dgx_spec, gb200_spec,
                                  hgx_b200_spec)
from tests.conftest import run_cli

CH0 = "/dev/nvidia-caps-imex-channels/channel0"


def fabric(host, spec: HostSpec, *, record: bool = False):
    write_host(host, spec)
    root = Root(host, record=record)
    return collect(root, nvml=False), root


def test_pci_nvswitches_are_an_nvswitch_fabric_and_the_planners_list_stays(tmp_path):
    f, _ = fabric(tmp_path, dgx_spec())
    fab = f.fabric
    assert fab.kind == "nvswitch"
    assert "4 NVSwitches on the PCI bus" in fab.why and "class 0x0680" in fab.why and "0000:c0:00.0" in fab.why
    assert [(d.role, d.name) for d in fab.devices] == [("nvswitch", "3rd-gen NVSwitch (LS10, NVLink4)")] * 4
    assert [(c.name, c.kind) for c in fab.wants] == [("fabricmanager", "daemon"), ("nscq", "library")]
    assert [s.pci_address for s in f.nvswitches] == [d.pci_address for d in fab.devices]


def test_an_a100_baseboards_switches_are_second_generation(tmp_path):
    spec = dgx_spec(nvswitches=0)
    spec.pci += [Pci(f"0000:{0xc0 + i:02x}:00.0", "0x10de", "0x1af1", "0x068000") for i in range(6)]
    fab = fabric(tmp_path, spec)[0].fabric
    assert fab.kind == "nvswitch" and "6 NVSwitches" in fab.why and "2nd-gen NVSwitch" in fab.why
    assert {d.name for d in fab.devices} == {"2nd-gen NVSwitch (LR10, NVLink3)"}


def test_hgx_b200_is_managed_through_the_bridges_limited_pfs(tmp_path):
    f, root = fabric(tmp_path, hgx_b200_spec())
    fab = f.fabric
    assert fab.kind == "nvlink5-switch-tray" and not f.nvswitches
    # the two LPFs (SMDL=SW_MNG), not the bridge's full PFs (SMDL=0) nor the eight compute NICs
    assert [(d.pci_address, d.role, d.ib_device, d.evidence) for d in fab.devices] == [
        ("0000:a5:00.1", "switch-tray-manager", "mlx5_9", "VPD SMDL=SW_MNG"),
        ("0000:a6:00.1", "switch-tray-manager", "mlx5_11", "VPD SMDL=SW_MNG")]
    assert "0000:a5:00.1, 0000:a6:00.1" in fab.why and "SMDL=SW_MNG" in fab.why and "no NVSwitch" in fab.why
    fm, sm = fab.wants
    assert fm.name == "fabricmanager" and fm.after_modules == ()
    assert sm.name == "nvlsm" and {"ib_core", "ib_umad"} <= set(sm.after_modules)
    assert sm.waiting_for == ("ib_umad",)              # the tree loads mlx5_core and ib_core, not ib_umad
    write_modules(tmp_path, hgx_b200_spec().modules + [Module("ib_umad", 40000, 0, (), "")])
    assert collect(root, nvml=False).fabric.want("nvlsm").waiting_for == ()


def test_gb200_tray_is_imex_and_names_the_channel_it_lacks(tmp_path):
    fab = fabric(tmp_path, gb200_spec())[0].fabric
    assert fab.kind == "nvlink5-imex"
    assert "NVIDIA Grace (soc_id jep106:036b:0241)" in fab.why and "4 Blackwell GPUs (NVIDIA GB200)" in fab.why
    assert fab.cpu and [d.device_id for d in fab.devices] == [GB200] * 4
    daemon, channel = fab.wants
    assert (daemon.name, daemon.kind) == ("imex", "daemon")
    assert (channel.name, channel.kind, channel.path, channel.present) == ("imex-channel0", "device", CH0, False)
    assert "NVreg_CreateImexChannel0=1" in channel.how and "/proc/devices" in channel.how
    assert fab.imex_channels == () and fab.imex_major is None


def test_gb200_with_the_driver_loaded_has_its_channel_and_major(tmp_path):
    f, _ = fabric(tmp_path, gb200_spec("580.95.05"))
    fab = f.fabric
    assert f.driver.loaded and fab.kind == "nvlink5-imex"
    assert fab.imex_channels == (CH0,) and fab.imex_major == IMEX_MAJOR
    ch = fab.want("imex-channel0")
    assert ch.present and f"({IMEX_MAJOR} now)" in ch.how


def test_grace_hopper_is_no_imex_fabric(tmp_path):
    spec = gb200_spec()
    spec.pci = [Pci("0009:01:00.0", "0x10de", "0x2342", "0x030200", None, 0, "0x10de", "0x16eb")]   # GH200
    fab = fabric(tmp_path, spec)[0].fabric
    assert fab.kind == "none" and "NVIDIA Grace" in fab.why and fab.wants == ()


def test_blackwell_without_grace_or_sw_mng_is_none(tmp_path):
    fab = fabric(tmp_path, hgx_b200_spec(bridge=False))[0].fabric
    assert fab.kind == "none" and fab.wants == () and fab.devices == ()
    assert "8 GPUs" in fab.why and "no ConnectX function with SMDL=SW_MNG" in fab.why


@pytest.mark.parametrize("device,sub,count", [("0x2335", "0x18be", 1), ("0x233b", "0x1996", 2),
                                              ("0x2331", "0x1626", 4), ("0x2321", "0x1839", 3)])
def test_the_pcie_gpu_machines_shape_is_none_without_reading_vpd(tmp_path, device, sub, count):
    """1-4 H200/H100 GPUs and a ConnectX NIC, no NVSwitch (the GPU machines of this project): no fabric, and
    not one VPD read on the way (VPD is a slow config-space walk; only Blackwell-generation hosts need it)."""
    spec = HostSpec(pci=[Pci(f"0000:{0x18 + i:02x}:00.0", "0x10de", device, "0x030200", "nvidia", 0, "0x10de", sub)
                         for i in range(count)]
                    + [Pci("0000:0c:00.0", "0x15b3", CX7, IB_CLASS, "mlx5_core", 0, "0x15b3", "0x0041",
                           cx7_vpd("MT0000", "SW_MNG"), "mlx5_0")])
    f, root = fabric(tmp_path, spec, record=True)
    assert f.fabric.kind == "none" and f.fabric.wants == ()
    assert f"{count} GPU" in f.fabric.why and "no NVSwitch on PCI" in f.fabric.why
    assert not [p for p in root.recorded if p.endswith("/vpd")]


def test_a_host_without_gpus_has_no_fabric(tmp_path):
    fab = fabric(tmp_path, HostSpec())[0].fabric
    assert (fab.kind, fab.why) == ("none", "no NVIDIA GPU on this host: no GPU fabric to set up")


def test_an_unreadable_vpd_makes_it_unknown_not_none(tmp_path):
    spec = hgx_b200_spec(gpus=8)
    write_host(tmp_path, spec)
    for addr in ("0000:a5:00.1", "0000:a6:00.1"):      # what an unprivileged reader meets: the file, no content
        vp = tmp_path / f"sys/devices/pci0000:00/{addr}/vpd"
        vp.unlink()
        os.mkfifo(vp)
    fab = collect(Root(tmp_path), nvml=False).fabric
    assert fab.kind == "unknown" and len(fab.unreadable) == 2 and "could not be read" in fab.why


# -- the VPD format -------------------------------------------------------------------------------------------
def test_vpd_round_trip_and_checksum():
    raw = cx7_vpd("MT2405XZ0001", "SW_MNG")
    assert raw[0] == vpd.TAG_ID_STRING and raw[-1] == vpd.TAG_END
    v = vpd.parse(raw)
    assert v.problem is None and v.checksum_ok is True and v.identifier.startswith("NVIDIA ConnectX-7")
    assert v.text("SN") == "MT2405XZ0001" and v.text("PN") == "MCX75310AAS-NEAT"
    assert vpd.vendor_fields(v)["SMDL"] == "SW_MNG" and vpd.vendor_fields(v)["MN"] == "MLNX"
    bad = bytearray(raw)
    bad[5] ^= 0x01                                          # one bit of the identifier string
    assert vpd.parse(bytes(bad)).checksum_ok is False


def test_vpd_sw_mng_outside_a_vendor_field_does_not_count(tmp_path):
    """The marker is the SMDL field of a vendor-specific keyword, not the bytes anywhere: a product string or
    serial number that happens to hold them is no switch-tray manager."""
    raw = vpd_image("SMDL=SW_MNG evaluation board", [("SN", "SMDL=SW_MNG"), ("VA", "MLX:MN=MLNX:SMDL=0")])
    assert b"SMDL=SW_MNG" in raw and vpd.vendor_fields(vpd.parse(raw)).get("SMDL") == "0"
    spec = hgx_b200_spec(bridge=False)
    spec.pci.append(Pci("0000:a5:00.1", "0x15b3", CX7, IB_CLASS, "mlx5_core", 1, "0x15b3", "0x0041", raw))
    assert fabric(tmp_path, spec)[0].fabric.kind == "none"


@pytest.mark.parametrize("raw,problem", [
    (b"", "empty"),
    (b"\x82\x40\x00abc", "claims 64 bytes"),
    (cx7_vpd("MT1")[:-1], "no end tag"),
    (b"\x90\x05\x00P\xffN\x00\x00\x78", "not a keyword"),
])
def test_damaged_vpd_is_parsed_as_far_as_it_goes(raw, problem):
    v = vpd.parse(raw)
    assert problem in v.problem


def test_vpd_padding_of_older_kernels_is_no_problem():
    raw = cx7_vpd("MT1", "SW_MNG")
    v = vpd.parse(raw + b"\xff" * (vpd.MAX_SIZE - len(raw)))
    assert v.problem is None and vpd.vendor_fields(v)["SMDL"] == "SW_MNG"
    # without the end tag, the 0xff fill ends the walk and what came before stays
    assert vpd.vendor_fields(vpd.parse(raw[:-1] + b"\xff" * 64))["SMDL"] == "SW_MNG"


# -- detect ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,kind,want,gpus", [
    (hgx_b200_spec, "nvlink5-switch-tray", ["fabricmanager", "nvlsm"], [B200] * 8),
    (lambda: gb200_spec("580.95.05"), "nvlink5-imex", ["imex", "imex-channel0"], [GB200] * 4)])
def test_detect_json_and_text_carry_the_fabric(tmp_path, spec, kind, want, gpus):
    write_host(tmp_path, spec())
    res = run_cli("detect", "--root", str(tmp_path), "--json", "--no-nvml", check=True)
    d = json.loads(res.stdout)
    assert list(d) == [f.name for f in dataclasses.fields(Facts)]       # one added key, the others as they were
    fab = d["fabric"]
    assert fab["kind"] == kind and [c["name"] for c in fab["wants"]] == want and fab["why"]
    assert d["nvswitches"] == [] and [g["device_id"] for g in d["gpus"]] == gpus
    text = run_cli("detect", "--root", str(tmp_path), "--no-nvml", check=True).stdout.splitlines()
    line = next(ln for ln in text if ln.startswith("fabric "))
    assert line == f"fabric      {kind}: {fab['why']}"
    assert text[text.index(line) + 1].startswith("  wants: " + want[0])
