"""`driverd demo --workdir DIR` (issue 30): the demo writes a sandbox into DIR and deletes it again on
the next run, so DIR must be the user's own — never a symbolic link (another user's link in /tmp would
aim the demo's writes and rmtree wherever that user likes), never in a directory others can change,
never a non-empty directory the demo did not make. Each refusal is one line, exit 2, nothing written."""
from __future__ import annotations

import os

import pytest

from driverd.errors import UsageError
from tests.conftest import run_cli

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def prepare_workdir(path):
    from driverd.cli.demo import prepare_workdir
    return prepare_workdir(path)


def _refused(path, *words):
    with pytest.raises(UsageError) as e:
        prepare_workdir(str(path))
    line = e.value.one_line()
    assert line.startswith(f"refusing demo workdir {path}: ") and "\n" not in line and e.value.exit_code == 2, line
    for w in words:
        assert w in line, line
    return line


def _sticky_tmp(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    return tmp


def test_a_new_directory_is_created_private_and_marked(tmp_path):
    from driverd.cli.demo import MARKER
    wd = prepare_workdir(str(tmp_path / "a/b/demo"))
    assert wd == tmp_path / "a/b/demo" and (wd / MARKER).is_file()
    assert oct(os.stat(wd).st_mode & 0o777) == oct(0o700) and oct(os.stat(tmp_path / "a").st_mode & 0o777) == oct(0o700)
    (wd / "host").mkdir()
    assert prepare_workdir(str(wd)) == wd                 # its own sandbox again: fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_workdir(str(empty)) == empty and (empty / MARKER).exists()


def test_a_symlink_is_refused_even_to_ones_own_directory(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    link = tmp_path / "demo"
    link.symlink_to(target)
    _refused(link, "it is a symbolic link", "pass the directory itself")
    assert list(target.iterdir()) == []


@as_root
def test_another_users_symlink_in_tmp_is_never_followed(tmp_path):
    """The attack: another user plants /tmp/driverd-demo -> a directory of the victim's; the victim's
    demo would write its sandbox there and, on the next run, rmtree its host/."""
    tmp = _sticky_tmp(tmp_path)
    victim = tmp_path / "victim"
    (victim / "host").mkdir(parents=True)
    (victim / "host/precious").write_text("keep me\n")
    link = tmp / "driverd-demo"
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)
    r = run_cli("demo", "--workdir", str(link))
    assert r.returncode == 2 and "refusing demo workdir" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert (victim / "host/precious").read_text() == "keep me\n" and sorted(p.name for p in victim.iterdir()) == ["host"]
    _refused(link, f"the symbolic link {link} in the shared directory {tmp} belongs to uid {NOBODY}")
    _refused(link / "sub", f"the symbolic link {link}")           # not through it either


@as_root
def test_a_directory_another_user_made_in_tmp_is_refused(tmp_path):
    tmp = _sticky_tmp(tmp_path)
    theirs = tmp / "driverd-demo"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    _refused(theirs, f"belongs to uid {NOBODY}")
    _refused(theirs / "x", f"belongs to uid {NOBODY}")


def test_a_parent_others_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    _refused(shared / "demo", f"the directory {shared} is writable by its group and everyone", "no sticky bit",
             f"chmod go-w {shared}")
    assert not (shared / "demo").exists()


def test_a_workdir_others_can_write_is_refused(tmp_path):
    wd = tmp_path / "demo"
    wd.mkdir()
    os.chmod(wd, 0o777)
    _refused(wd, "others can write to it (mode 0777)")


def test_a_non_empty_directory_the_demo_did_not_make_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work\n")
    _refused(home, "it is not empty and the demo did not make it", "pass a new or empty directory")
    assert sorted(p.name for p in home.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("option", ["--root", "--config"])
def test_demo_refuses_a_root_or_config_it_would_ignore(tmp_path, option):
    """issue 32: `driverd demo --root DIR` was accepted and ignored - the demo builds its own sandbox
    host and configuration, so a --root (or --config) that seems to point it at a host is refused
    before anything is made: one line, exit 2, nothing written under the workdir or DIR."""
    target = tmp_path / "target"
    target.mkdir()
    arg = str(target if option == "--root" else target / "config.toml")
    for argv in (("demo", option, arg, "--workdir", str(tmp_path / "wd")),
                 (option, arg, "demo", "--workdir", str(tmp_path / "wd"))):
        r = run_cli(*argv)
        assert r.returncode == 2, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"demo does not take {option}" in lines[0] and "--workdir" in lines[0], r.stderr
        assert not (tmp_path / "wd").exists() and list(target.iterdir()) == []
    r = run_cli("demo", "--root", str(tmp_path / "missing"))
    assert r.returncode == 2 and "demo does not take --root" in r.stderr, r.stderr
