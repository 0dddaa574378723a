from driverd.host import collect
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Pci, write_host


def nouveau(tmp_path, **kw):
    write_host(tmp_path, HostSpec(**kw))
    return collect(Root(tmp_path), nvml=False).nouveau


def test_loaded_and_bound(tmp_path):
    n = nouveau(tmp_path, pci=[Pci("0000:01:00.0", "0x10de", "0x1eb8", "0x030200", "nouveau")],
                modules=[Module("nouveau", 2000000, 1, (), ""), Module("drm", 600000, 2, ("nouveau",), "")])
    assert n.loaded and n.refcount == 1 and n.bound_devices == ("0000:01:00.0",)
    assert not n.blacklisted


def test_blacklist_in_usr_lib(tmp_path):
    n = nouveau(tmp_path, modprobe_d={"/usr/lib/modprobe.d/nvidia.conf": "blacklist nouveau\noptions nouveau modeset=0\n"})
    assert n.blacklisted and n.modeset_disabled and n.blacklist_sources == ("/usr/lib/modprobe.d/nvidia.conf",)


def test_etc_file_overrides_same_name_in_lib(tmp_path):
    # kmod: /etc/modprobe.d/x.conf hides /lib/modprobe.d/x.conf
    n = nouveau(tmp_path, modprobe_d={"/lib/modprobe.d/nvidia.conf": "blacklist nouveau\n",
                                      "/etc/modprobe.d/nvidia.conf": "# emptied by the admin\n"})
    assert not n.blacklisted


def test_cmdline_and_install_false(tmp_path):
    n = nouveau(tmp_path, cmdline="ro modprobe.blacklist=nouveau,radeon nouveau.modeset=0")
    assert n.blacklisted and n.modeset_disabled
    n2 = nouveau(tmp_path / "b", modprobe_d={"/etc/modprobe.d/x.conf": "install nouveau /bin/false\n"})
    assert n2.blacklisted


def test_comments_and_continuations(tmp_path):
    n = nouveau(tmp_path, modprobe_d={"/etc/modprobe.d/x.conf": "# blacklist nouveau\nblacklist \\\n  nouveau\n"})
    assert n.blacklisted
    n2 = nouveau(tmp_path / "b", modprobe_d={"/etc/modprobe.d/x.txt": "blacklist nouveau\n"})
    assert not n2.blacklisted   # kmod reads only *.conf
