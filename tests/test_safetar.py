"""driverd.safetar: the one extractor for every archive driverd (and its tests) unpack. It must refuse the
same things on every interpreter driverd supports (tarfile's `filter=` is absent before 3.11.4, and
Debian 12's python3 is 3.11.2), write nothing outside the destination, and never write through a link."""
from __future__ import annotations

import ast
import io
import os
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from driverd import safetar
from driverd.errors import PackageError
from tests.conftest import HOSTS, REPO


def _tar(path: Path, members: list[tuple]) -> Path:
    """members: (name, kind, payload) with kind file|dir|sym|hard|chr|fifo; payload = data or link target."""
    with tarfile.open(path, "w:gz") as t:
        for name, kind, payload, *mode in members:
            ti = tarfile.TarInfo(name)
            ti.mode = mode[0] if mode else 0o644
            data = None
            if kind == "file":
                data = payload.encode()
                ti.size = len(data)
            elif kind == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            elif kind == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, payload
            elif kind == "hard":
                ti.type, ti.linkname = tarfile.LNKTYPE, payload
            elif kind == "chr":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            elif kind == "fifo":
                ti.type = tarfile.FIFOTYPE
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return path


def _outside_untouched(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in ("a.tgz", "dest"))


@pytest.mark.parametrize("links", ["refuse", "inside", "rooted"])
@pytest.mark.parametrize("members,why", [
    ([("/etc/evil", "file", "x")], "has an absolute path"),
    ([("ok/../../evil", "file", "x")], "contains '..'"),
    ([("dev", "chr", "")], "device node or FIFO"),
    ([("pipe", "fifo", "")], "device node or FIFO"),
    ([("a", "file", "x"), ("b", "hard", "a")], "is a hard link"),
    ([("up", "sym", "../../etc")], "symlink"),
    ([("x/up", "sym", "../..")], "symlink"),
    ([("l1", "sym", "."), ("l2", "sym", "l1/..")], "symlink"),
    # the classic: a link, then a file "through" it
    ([("usr/lib", "dir", ""), ("lib", "sym", "usr/lib"), ("lib/evil", "file", "x")], "symlink"),
    ([("run", "sym", "/etc"), ("run/evil", "file", "x")], "symlink"),
])
def test_refusals_name_the_member_and_write_nothing_outside(tmp_path, members, why, links):
    arc = _tar(tmp_path / "a.tgz", members)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(safetar.UnsafeMember) as e:
        safetar.extract_file(arc, dest, links=links)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("member '")
    assert _outside_untouched(tmp_path) == []
    assert not Path("/etc/evil").exists()


def test_link_policies(tmp_path):
    rel = [("usr/lib/os-release", "file", "ID=debian\n"), ("etc/os-release", "sym", "../usr/lib/os-release")]
    absolute = [("var/run", "sym", "/run")]
    for links, members, ok in (("refuse", rel, False), ("inside", rel, True), ("rooted", rel, True),
                               ("inside", absolute, False), ("rooted", absolute, True)):
        dest = tmp_path / f"{links}-{len(members)}"
        dest.mkdir()
        arc = _tar(tmp_path / f"{dest.name}.tgz", members)
        if ok:
            safetar.extract_file(arc, dest, links=links)
            link = dest / members[-1][0]
            assert link.is_symlink() and os.readlink(link) == members[-1][2]
        else:
            with pytest.raises(safetar.UnsafeMember, match="symlink"):
                safetar.extract_file(arc, dest, links=links)
    assert (tmp_path / "inside-2/etc/os-release").read_text() == "ID=debian\n"


def test_modes_owner_bits_kept_setid_and_group_write_dropped(tmp_path):
    arc = _tar(tmp_path / "a.tgz", [("bin/tool", "file", "#!/bin/sh\n", 0o6777), ("ro", "file", "x", 0o400),
                                    ("d", "dir", "")])
    dest = tmp_path / "dest"
    dest.mkdir()
    assert safetar.extract_file(arc, dest, links="refuse") == 3
    assert stat.S_IMODE((dest / "bin/tool").stat().st_mode) == 0o755
    assert stat.S_IMODE((dest / "ro").stat().st_mode) == 0o600
    assert stat.S_IMODE((dest / "d").stat().st_mode) == 0o755


def test_captured_hosts_unpack_with_their_links(unpack_host):
    for cap in sorted(HOSTS.glob("*.tar.gz")):
        root = unpack_host(cap.name)
        assert os.readlink(root / "var/run") == "/run"
        assert (root / "etc/os-release").read_text().startswith(("PRETTY_NAME", "NAME", "ID"))
        assert any((root / "sys/bus/pci/devices").iterdir())


def test_source_tarball_with_an_escaping_link_is_refused_and_nothing_kept(tmp_path):
    from driverd.build.modules import prepare_source
    good = [("nv/modules/nvidia-open-kernel/Kbuild", "file", 'ccflags-y += -DNV_VERSION_STRING=\\"535.261.03\\"\n'),
            ("nv/modules/nvidia-open-kernel/Makefile", "file", ""),
            ("nv/modules/nvidia-open-kernel/nvidia/nv.c", "file", ""),
            ("nv/modules/nvidia-open-kernel/common", "sym", "nvidia")]
    src = prepare_source(_tar(tmp_path / "good.tgz", good), tmp_path / "work")
    assert src.version == "535.261.03" and (src.tree / "common").is_symlink()
    bad = _tar(tmp_path / "bad.tgz", good + [("nv/modules/nvidia-open-kernel/k", "sym", "/lib/modules")])
    with pytest.raises(PackageError) as e:
        prepare_source(bad, tmp_path / "work")
    assert "symlink to the absolute path '/lib/modules'" in e.value.message
    assert [p.name for p in (tmp_path / "work/sources").iterdir() if p.name.startswith(".extract")] == []


def _tar_extraction_calls(path: Path) -> list[str]:
    """tarfile's own extract/extractall, or any call passing filter=: interpreter-dependent behaviour."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("extractall", "extract") or (
                    node.func.attr in ("open",) and any(k.arg == "filter" for k in node.keywords)):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return hits


def test_nothing_calls_tarfiles_own_extraction():
    files = [p for d in ("driverd", "tests", "bench", "tools") for p in (REPO / d).rglob("*.py")]
    hits = [h for p in files for h in _tar_extraction_calls(p)]
    assert hits == [], f"use driverd.safetar instead: {hits}"


def test_the_suite_runs_on_the_systems_python_in_ci():
    """.ci/setup-venv builds .venv from /usr/bin/python3 (Debian 12: 3.11.2, the images' interpreter)."""
    if not os.environ.get("CI") or not os.path.exists("/usr/bin/python3"):
        pytest.skip("only CI pins the interpreter")
    system = subprocess.run(["/usr/bin/python3", "-c", "import os, sys; print(os.path.realpath(sys.executable))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.realpath(sys._base_executable) == system
