from driverd.host import collect
from driverd.driver.ident import parse_version_file as parse_nvidia_version
from driverd.host.modules import parse_proc_modules
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, h100, nvidia_version_line, write_host

PROC_MODULES = """\
nvidia_uvm 1519616 2 - Live 0xffffffffc1a00000 (POE)
nvidia_drm 73728 0 - Live 0xffffffffc19e0000 (POE)
nvidia_modeset 1294336 1 nvidia_drm, Live 0xffffffffc1890000 (POE)
nvidia 56381440 19 nvidia_uvm,nvidia_modeset, Live 0xffffffffbe200000 (POE)
video 65536 1 [permanent], Live 0xffffffffc0e8e000
ext4 991232 1 - Live 0xffffffffc0e9d000
"""


def test_parse_proc_modules():
    m = parse_proc_modules(PROC_MODULES)
    assert m["nvidia"]["refcount"] == 19 and m["nvidia"]["used_by"] == ("nvidia_uvm", "nvidia_modeset")
    assert m["nvidia"]["taints"] == "POE" and m["nvidia"]["state"] == "Live"
    assert m["video"]["permanent"] and m["video"]["used_by"] == ()
    assert m["ext4"]["taints"] == ""


def test_parse_proc_modules_without_unload():
    m = parse_proc_modules("nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)\n")
    assert m["nvidia_uvm"]["refcount"] is None and m["nvidia_uvm"]["taints"] == "O"


def test_nvidia_version_flavours():
    assert parse_nvidia_version(nvidia_version_line("535.261.03", "open"))[:2] == ("535.261.03", "open")
    assert parse_nvidia_version(nvidia_version_line("470.256.02", "proprietary"))[:2] == ("470.256.02", "proprietary")
    assert parse_nvidia_version("garbage\n")[:2] == (None, None)
    assert parse_nvidia_version(None) == (None, None, None)


def test_driver_facts_with_holders(tmp_path):
    mods = [Module("nvidia", 56381440, 3, ("nvidia_uvm", "nvidia_modeset"), version="550.127.05"),
            Module("nvidia_uvm", 1519616, 0), Module("nvidia_modeset", 1294336, 0)]
    write_host(tmp_path, HostSpec(pci=[h100("0000:01:00.0", "nvidia")], modules=mods,
                                  nvidia_version_text=nvidia_version_line("550.127.05", "proprietary")))
    f = collect(Root(tmp_path), nvml=False)
    assert f.driver.loaded and f.driver.version == "550.127.05" and f.driver.flavor == "proprietary"
    nv = next(m for m in f.driver.modules if m.name == "nvidia")
    assert nv.refcount == 3 and nv.holders == ("nvidia_modeset", "nvidia_uvm")


def test_garbled_driver_version_is_a_warning(tmp_path):
    write_host(tmp_path, HostSpec(modules=[Module("nvidia", version="550.127.05")], nvidia_version_text="???\n"))
    f = collect(Root(tmp_path), nvml=False)
    assert f.driver.loaded and f.driver.version == "550.127.05"
    assert any("garbled" in w for w in f.warnings)
