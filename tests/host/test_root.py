import os

from driverd.root import Root


def test_absolute_symlink_resolves_inside_root(tmp_path):
    (tmp_path / "usr/src/linux-headers-6.1.0-47-amd64").mkdir(parents=True)
    (tmp_path / "usr/src/linux-headers-6.1.0-47-amd64/Makefile").write_text("x")
    (tmp_path / "lib/modules/6.1.0-47-amd64").mkdir(parents=True)
    os.symlink("/usr/src/linux-headers-6.1.0-47-amd64", tmp_path / "lib/modules/6.1.0-47-amd64/build")
    root = Root(tmp_path)
    assert root.resolve("/lib/modules/6.1.0-47-amd64/build/Makefile") == "/usr/src/linux-headers-6.1.0-47-amd64/Makefile"
    assert root.read_text("/lib/modules/6.1.0-47-amd64/build/Makefile") == "x"


def test_the_on_disk_strings_are_the_paths_handed_out(tmp_path):
    """on_disk, real_on_disk and safe_on_disk (the strings detect reads by) name what path, real and
    safe_real do, links resolved inside the root the same way; a name the OS refuses is None, not an error."""
    (tmp_path / "usr/lib").mkdir(parents=True)
    os.symlink("/usr/lib", tmp_path / "lib")
    os.symlink("../../../../etc/shadow", tmp_path / "usr/lib/away")
    root = Root(tmp_path)
    for hp in ("/lib", "lib/x", "/usr/lib/away", "/nope/../usr"):
        assert root.on_disk(hp) == str(root.path(hp)) and Root("/").on_disk(hp) == str(Root("/").path(hp))
        assert root.real_on_disk(hp) == str(root.real(hp))
        assert root.safe_on_disk(hp) == str(root.safe_real(hp))
    assert Root(tmp_path).real_on_disk("/lib/x") == f"{tmp_path}/usr/lib/x"
    assert Root(tmp_path).real_on_disk("/usr/lib/away") == f"{tmp_path}/etc/shadow"
    assert Root(tmp_path).safe_on_disk("/bad\0name") is None and Root(tmp_path).safe_real("/bad\0name") is None


def test_symlink_cannot_escape_root(tmp_path):
    (tmp_path / "etc").mkdir()
    os.symlink("../../../../../../etc/passwd", tmp_path / "etc/escape")
    root = Root(tmp_path)
    assert root.resolve("/etc/escape") == "/etc/passwd"
    assert root.read_text("/etc/escape") is None   # /etc/passwd does not exist inside the tree


def test_missing_and_unreadable_return_none(tmp_path):
    root = Root(tmp_path)
    assert root.read_text("/nope") is None
    assert root.listdir("/nope") == []
    assert root.readlink("/nope") is None


def test_recording_lists_links_and_targets(tmp_path):
    (tmp_path / "sys/devices/pci0000:00/0000:00:06.0").mkdir(parents=True)
    (tmp_path / "sys/devices/pci0000:00/0000:00:06.0/vendor").write_text("0x10de\n")
    (tmp_path / "sys/bus/pci/devices").mkdir(parents=True)
    os.symlink("../../../devices/pci0000:00/0000:00:06.0", tmp_path / "sys/bus/pci/devices/0000:00:06.0")
    root = Root(tmp_path, record=True)
    assert root.read_first_line("/sys/bus/pci/devices/0000:00:06.0/vendor") == "0x10de"
    assert "/sys/bus/pci/devices/0000:00:06.0" in root.recorded
    assert "/sys/devices/pci0000:00/0000:00:06.0/vendor" in root.recorded


def test_live_detection(tmp_path):
    assert Root("/").is_live()
    assert not Root(tmp_path).is_live()
