"""`driverd build-companion` (driverd.build.companion): what it refuses — in one line naming the file and why, writing
nothing to the output directory — the check against NVIDIA's redistrib JSON before anything is unpacked, the driver
version of a component versioned on its own (NVLSM), and the command's output and exit codes.

No real NVIDIA archive is reachable from the machines this suite runs on: the archives and JSON files are made here in
NVIDIA's documented layout (tests/packages/companionfake.py)."""
from __future__ import annotations

import json
import os

import pytest

from driverd.build.companion import build_from_archive
from driverd.errors import PackageError
from tests.conftest import run_cli
from tests.packages import companionfake as cf

V = cf.V


def _refused(tmp_path, archive, name: str | None = None, **kw) -> str:
    """The one line a build of `archive` is refused with; the output directory keeps only what it held."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "already-here").write_text("x")
    with pytest.raises(PackageError) as e:
        build_from_archive(archive, out, **kw)
    line = e.value.one_line()
    assert len(line.splitlines()) == 1 and "fix: " in line, line
    assert (name or archive.name) in line, line
    assert sorted(os.listdir(out)) == ["already-here"], "a refused build writes nothing to the output directory"
    return line


def _edited(tmp_path, edit, component="fabricmanager", **kw):
    return cf.archive(tmp_path / "src", component, edit=edit, **kw)


@pytest.mark.parametrize("case,expect", [
    ("link-out", "link lib/libevil.so -> ../../../etc/passwd points out of the tree"),
    # inside the archive's root, one level above its top directory: still out of the package's tree
    ("link-just-above", "link LICENSE.txt -> ../notes points out of the tree"),
    ("link-absolute", "link lib/libevil.so -> /etc/shadow points out of the tree"),
    ("setuid", "bin/nv-fabricmanager is setuid or setgid (mode 4755)"),
    ("setgid", "bin/nvswitch-audit is setuid or setgid (mode 2755)"),
    ("hard-link", "is a hard link"),
    ("fifo", "is a device node or FIFO"),
    ("outside-top", "is outside its top directory fabricmanager-linux-x86_64-550.163.01-archive/"),
    ("foreign-soname", "libnvfm.so.1 declares the soname libz.so.1, not one of libnvfm's"),
    ("dangling-link", "link lib/libnvfm.so -> libnvfm.so.7 ends at nothing in the archive"),
    ("directory-link", "link share/nvidia/current -> nvswitch ends at the directory share/nvidia/nvswitch/"),
])
def test_an_unsafe_archive_is_refused_in_one_line_and_nothing_is_written(tmp_path, case, expect):
    edits = {
        "link-out": lambda ms: ms + [cf.M("lib/libevil.so", link="../../../etc/passwd", kind="link")],
        "link-just-above": lambda ms: ms + [cf.M("LICENSE.txt", link="../notes", kind="link")],
        "link-absolute": lambda ms: ms + [cf.M("lib/libevil.so", link="/etc/shadow", kind="link")],
        "setuid": lambda ms: cf.swap(ms, "bin/nv-fabricmanager", mode=0o4755),
        "setgid": lambda ms: cf.swap(ms, "bin/nvswitch-audit", mode=0o2755),
        "hard-link": lambda ms: ms + [cf.M("bin/nv-fm-hard", link="bin/nv-fabricmanager", kind="hard")],
        "fifo": lambda ms: ms + [cf.M("etc/pipe", kind="fifo")],
        "foreign-soname": lambda ms: cf.swap(ms, "lib/libnvfm.so.1", so="libz.so.1"),
        "dangling-link": lambda ms: cf.swap(ms, "lib/libnvfm.so", link="libnvfm.so.7"),
        "directory-link": lambda ms: ms + [cf.M("share/nvidia/current", link="nvswitch", kind="link")],
    }
    kw = {"top": "fabricmanager"} if case == "outside-top" else {}
    a = _edited(tmp_path, edits.get(case), **kw)
    line = _refused(tmp_path, a)
    assert expect in line, line


def test_a_truncated_or_corrupt_archive_is_refused(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    data = a.read_bytes()
    a.write_bytes(data[: len(data) // 2])
    assert "is truncated or corrupt" in _refused(tmp_path, a)
    mid = len(data) // 2
    a.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 64]) + data[mid + 64:])
    assert "is truncated or corrupt" in _refused(tmp_path, a)
    a.write_bytes(b"")
    assert "is truncated or corrupt (empty file)" in _refused(tmp_path, a)


def test_an_unknown_component_or_a_name_not_nvidias_is_refused(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    for name, expect in [("cuda_nvcc-linux-x86_64-12.4.131-archive.tar.xz", "unknown component 'cuda_nvcc'"),
                         ("fabricmanager-linux-ppc64le-550.163.01-archive.tar.xz", "unknown platform linux-ppc64le"),
                         ("fabricmanager.tar.xz", "not the name of one of NVIDIA's redistributable archives")]:
        renamed = a.with_name(name)
        os.link(a, renamed)
        assert expect in _refused(tmp_path, renamed), name


def test_an_archive_of_another_version_than_driver_is_refused(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    line = _refused(tmp_path, a, driver="535.261.03")
    assert "is fabricmanager 550.163.01, not driver 535.261.03's" in line
    assert "cause: fabricmanager must be exactly the loaded driver's version" in line
    assert build_from_archive(a, tmp_path / "ok", driver=V).manifest.driver_version == V
    assert "--driver 'latest' is not a driver version" in _refused(tmp_path, a, driver="latest")


# -- NVIDIA's redistrib JSON -------------------------------------------------------------------------

def test_the_archive_is_checked_against_the_redistrib_json_before_it_is_unpacked(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    good = cf.redistrib(tmp_path / "src", [a])
    assert build_from_archive(a, tmp_path / "ok", redistrib=good).redistrib == good.name
    wrong_sha = cf.redistrib(tmp_path / "j1", [a], edit=lambda d: d["fabricmanager"]["linux-x86_64"]
                             .update(sha256="ab" * 32))
    line = _refused(tmp_path, a, redistrib=wrong_sha)
    assert "has sha256 " in line and f"redistrib_{V}.json says {'ab' * 32}" in line
    wrong_size = cf.redistrib(tmp_path / "j2", [a], edit=lambda d: d["fabricmanager"]["linux-x86_64"].update(size="12"))
    assert f"is {a.stat().st_size} bytes, redistrib_{V}.json says 12" in _refused(tmp_path, a, redistrib=wrong_size)
    # checked first: an archive that would be refused for its contents is refused for its sha256, unread
    setuid = cf.archive(tmp_path / "bad", "fabricmanager",
                        edit=lambda ms: cf.swap(ms, "bin/nv-fabricmanager", mode=0o4755))
    line = _refused(tmp_path, setuid, redistrib=good)
    assert "has sha256" in line and "setuid" not in line, line


def test_an_archive_the_json_does_not_list_or_a_json_that_is_not_one_is_refused(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    other = cf.archive(tmp_path / "other", "nscq")
    line = _refused(tmp_path, a, redistrib=cf.redistrib(tmp_path / "other", [other]))
    assert f"redistrib_{V}.json does not list it (no fabricmanager linux-x86_64 entry with this file name)" in line
    bad = tmp_path / "redistrib_x.json"
    bad.write_text("{not json")
    assert "redistrib_x.json: is not JSON" in _refused(tmp_path, a, name="redistrib_x.json", redistrib=bad)
    inf = cf.redistrib(tmp_path / "j4", [a], edit=lambda d: d["fabricmanager"]["linux-x86_64"].update(size=float("inf")))
    assert "entry has the size inf, not a number" in _refused(tmp_path, a, name=inf.name, redistrib=inf)
    js = cf.redistrib(tmp_path / "j3", [a], edit=lambda d: d["fabricmanager"].update(version="550.144.03"))
    assert "lists version 550.144.03 for it, its name says 550.163.01" in _refused(tmp_path, a, redistrib=js)


def test_nvlsm_goes_with_the_driver_the_json_names_or_driver_says(tmp_path):
    a = cf.archive(tmp_path / "src", "nvlsm")
    line = _refused(tmp_path, a)
    assert f"nvlsm is versioned on its own ({cf.NVLSM_V})" in line and "--redistrib" in line
    assert build_from_archive(a, tmp_path / "o1", driver="570.133.20").manifest.driver_version == "570.133.20"
    js = cf.redistrib(tmp_path / "src", [a], "570.133.20")
    m = build_from_archive(a, tmp_path / "o2", redistrib=js).manifest
    assert (m.driver_version, m.component_version) == ("570.133.20", cf.NVLSM_V)
    assert "is listed by redistrib_570.133.20.json of driver 570.133.20, not 550.163.01" in \
        _refused(tmp_path, a, redistrib=js, driver=V)
    # CUDA's own redist lists it too, under a CUDA release: that label is no driver version
    cuda = cf.redistrib(tmp_path / "cuda", [a], "12.8.1", product="cuda")
    assert "versioned on its own" in _refused(tmp_path, a, redistrib=cuda)


# -- the command -------------------------------------------------------------------------------------

def test_build_companion_command(tmp_path):
    a = cf.archive(tmp_path / "src", "fabricmanager")
    js = cf.redistrib(tmp_path / "src", [a])
    out = tmp_path / "repo"
    res = run_cli("build-companion", str(a), "--redistrib", str(js), "--driver", V, "--out", str(out), "--json",
                  check=True)
    r = json.loads(res.stdout)
    assert (r["component"], r["driver"], r["arch"], r["checked_against"]) == ("fabricmanager", V, "x86_64", js.name)
    assert r["libraries"] == {"lib/libnvfm.so.1": "libnvfm.so.1"} and r["links"] == {"lib/libnvfm.so": "libnvfm.so.1"}
    assert os.listdir(out) == [os.path.basename(r["package"])]
    text = run_cli("build-companion", str(a), "--out", str(out), check=True).stdout
    assert text.splitlines()[0] == r["package"] and "note: left out include/" in text
    # refused: exit 3, one line with the fix, nothing written
    res = run_cli("build-companion", str(a), "--driver", "535.261.03", "--out", str(tmp_path / "none"))
    assert res.returncode == 3 and len(res.stderr.strip().splitlines()) == 1 and "fix:" in res.stderr, res.stderr
    assert a.name in res.stderr and not (tmp_path / "none").exists()
    # a file that is not there: bad usage, exit 2
    res = run_cli("build-companion", str(tmp_path / "nothing.tar.xz"), "--out", str(out))
    assert res.returncode == 2 and "is not a file" in res.stderr and "fix:" in res.stderr
    res = run_cli("build-companion", str(a), "--redistrib", str(tmp_path / "none.json"), "--out", str(out))
    assert res.returncode == 2 and "--redistrib" in res.stderr
    helptext = run_cli("build-companion", "--help", check=True).stdout
    assert "examples:" in helptext and "build-companion fabricmanager-linux-x86_64-550.163.01-archive.tar.xz" in helptext
