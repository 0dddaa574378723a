from driverd.host import collect
from driverd.host.pci import classify, scan
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Pci, h100, write_host


def facts(tmp_path, pci):
    write_host(tmp_path, HostSpec(pci=pci))
    return collect(Root(tmp_path), nvml=False)


def test_gpus_switches_and_nics(tmp_path):
    f = facts(tmp_path, [
        h100("0000:1b:00.0", "nvidia", 0),
        Pci("0000:c3:00.0", "0x10de", "0x2901", "0x030200", None, 1),           # B200
        Pci("0000:05:00.0", "0x10de", "0x22a3", "0x068000", "nvidia-nvswitch"),  # NVSwitch gen 3
        Pci("0000:0c:00.0", "0x15b3", "0x101d", "0x020700", "mlx5_core"),       # ConnectX-6 Dx IB
        Pci("0000:00:02.0", "0x1af4", "0x1041", "0x020000", "virtio-pci"),
        Pci("0000:0d:00.0", "0x10de", "0x2330", "0x040300", "snd_hda_intel"),    # audio function: not a GPU
    ])
    by = {g.pci_address: g for g in f.gpus}
    assert set(by) == {"0000:1b:00.0", "0000:c3:00.0"}
    h = by["0000:1b:00.0"]
    assert (h.device_id, h.architecture, h.open_module_support, h.bound_driver, h.numa_node) == \
        ("0x2330", "Hopper", "supported", "nvidia", 0)
    assert h.subsystem_device_id == "0x16c1" and h.known
    b = by["0000:c3:00.0"]
    assert b.architecture == "Blackwell" and b.open_module_support == "required" and b.bound_driver is None
    assert [s.pci_address for s in f.nvswitches] == ["0000:05:00.0"]
    assert [n.pci_address for n in f.mellanox_nics] == ["0000:0c:00.0"]


def test_unknown_device_is_flagged_not_guessed(tmp_path):
    f = facts(tmp_path, [Pci("0000:01:00.0", "0x10de", "0xfff0", "0x030000")])
    g = f.gpus[0]
    assert (g.name, g.architecture, g.open_module_support, g.known) == ("unknown", "unknown", "unknown", False)
    assert any("0xfff0" in w and "not in driverd's GPU table" in w for w in f.warnings)


def test_garbled_sysfs_is_a_warning(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:01:00.0"), h100("0000:02:00.0")]))
    (tmp_path / "sys/devices/pci0000:00/0000:01:00.0/vendor").write_text("garbage\n")
    (tmp_path / "sys/devices/pci0000:00/0000:02:00.0/numa_node").write_text("x\n")
    w = []
    gpus, _, _ = classify(Root(tmp_path), scan(Root(tmp_path), w), w)
    assert [g.pci_address for g in gpus] == ["0000:02:00.0"] and gpus[0].numa_node is None
    assert any("0000:01:00.0" in x and "garbled" in x for x in w)
    assert any("numa_node" in x for x in w)


def test_uuid_and_minor_from_driver_information(tmp_path):
    info = ("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 41\nGPU UUID: \t GPU-4ba22e54-1086-e7cd-2c47-046899b49032\n"
            "Bus Location: \t 0000:1b:00.0\nDevice Minor: \t 3\nGPU Excluded:\t No\n")
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0", "nvidia")],
                                  files={"/proc/driver/nvidia/gpus/0000:1b:00.0/information": info}))
    g = collect(Root(tmp_path), nvml=False).gpus[0]
    assert g.uuid == "GPU-4ba22e54-1086-e7cd-2c47-046899b49032" and g.minor == 3
