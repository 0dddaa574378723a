"""Root's write API: every write resolves symlinks inside the root, exactly as the readers do, and
nothing is ever written outside the root. Each test runs twice: with openat2(RESOLVE_IN_ROOT) and
with the component-by-component walk forced."""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

import driverd.root as root_mod
from driverd.errors import HostPathError
from driverd.fsutil import atomic_write_json
from driverd.root import Root


@pytest.fixture
def mode(resolver):
    return resolver


def real_root_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A host tree with the links real roots have, and an `outside` directory next to it that
    absolute and relative links name on purpose: nothing may ever land there."""
    r = tmp_path / "root"
    outside = tmp_path / "outside"
    outside.mkdir()
    for d in ("usr/lib", "usr/bin", "usr/sbin", "usr/share", "etc/alternatives", "run/lock", "var/lib", "proc"):
        (r / d).mkdir(parents=True, exist_ok=True)
    os.symlink("usr/lib", r / "lib")                       # merged /usr, relative
    os.symlink("usr/bin", r / "bin")
    os.symlink("usr/sbin", r / "sbin")
    os.symlink("/run", r / "var/run")                      # Debian/Ubuntu default, absolute
    os.symlink("/run/lock", r / "var/lock")
    (r / "usr/bin/x.real").write_text("#!/bin/sh\n")
    os.chmod(r / "usr/bin/x.real", 0o755)
    os.symlink("/usr/bin/x.real", r / "etc/alternatives/x")
    os.symlink("/etc/alternatives/x", r / "usr/bin/x")     # /etc/alternatives chain
    os.symlink("/etc/modprobe.d", r / "etc/modprobe.d")    # hostile: itself, absolute -> loop
    os.symlink(str(outside), r / "etc/containerd")         # absolute: a path that exists on this machine
    os.symlink("../" * 12 + str(outside).lstrip("/"), r / "etc/docker")   # relative, climbing out
    os.symlink("/var/run/cdi", r / "etc/cdi")              # two absolute hops: /etc/cdi -> /var/run -> /run
    os.symlink("../lib/../share", r / "etc/physical")      # '..' after a link is physical: /usr/share
    return r, outside


def real_state(path: str):
    try:
        st = os.lstat(path)
        return st.st_mtime_ns, st.st_size
    except FileNotFoundError:
        return None


def files_under(p: Path) -> list[str]:
    return sorted(str(x.relative_to(p)) for x in p.rglob("*"))


def test_var_run_absolute_link_lands_in_root_run(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    real_before = real_state("/run/cdi/nvidia.yaml")
    root.atomic_write("/var/run/cdi/nvidia.yaml", "cdiVersion: 0.5.0\n")
    assert (r / "run/cdi/nvidia.yaml").read_text() == "cdiVersion: 0.5.0\n"
    assert os.readlink(r / "var/run") == "/run"            # the link itself is untouched
    assert real_state("/run/cdi/nvidia.yaml") == real_before   # this machine's /run: never
    root.atomic_write("/var/lock/driverd.lock", b"1\n")
    assert (r / "run/lock/driverd.lock").read_bytes() == b"1\n"
    root.atomic_write("/etc/cdi/nvidia.yaml", "via two links\n")
    assert (r / "run/cdi/nvidia.yaml").read_text() == "via two links\n"
    assert files_under(outside) == []


def test_merged_usr_relative_links(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    root.atomic_write("/lib/firmware/nvidia/535/gsp.bin", b"\0fw")
    assert (r / "usr/lib/firmware/nvidia/535/gsp.bin").read_bytes() == b"\0fw"
    assert root.makedirs("/lib/modules/6.1.0-47-amd64/updates") == r / "usr/lib/modules/6.1.0-47-amd64/updates"
    assert (r / "usr/lib/modules/6.1.0-47-amd64/updates").is_dir() and os.path.islink(r / "lib")
    assert root.write_target("/sbin/tool") == r / "usr/sbin/tool"
    assert root.write_target("/etc/physical/f") == r / "usr/share/f" == root.real("/etc/physical/f")
    assert files_under(outside) == []


def test_alternatives_chain_replaces_the_final_target(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    root = Root(r)
    root.atomic_write("/usr/bin/x", "#!/bin/sh\necho new\n")
    assert os.readlink(r / "usr/bin/x") == "/etc/alternatives/x"          # links kept, as editors do
    assert os.readlink(r / "etc/alternatives/x") == "/usr/bin/x.real"
    assert (r / "usr/bin/x.real").read_text() == "#!/bin/sh\necho new\n"
    assert stat.S_IMODE(os.stat(r / "usr/bin/x.real").st_mode) == 0o755    # mode kept
    assert root.write_target("/usr/bin/x") == r / "usr/bin/x.real"


def test_dangling_final_link_creates_its_target_inside_root(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    os.symlink("/etc/site/containerd.toml", r / "etc/config.toml")
    root = Root(r)
    root.atomic_write("/etc/config.toml", "version = 2\n")
    assert (r / "etc/site/containerd.toml").read_text() == "version = 2\n"
    assert os.path.islink(r / "etc/config.toml")


def test_links_that_point_outside_stay_inside(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    root.atomic_write("/etc/containerd/config.toml", "a\n")
    root.atomic_write("/etc/docker/daemon.json", "{}\n")
    inner = r / str(outside).lstrip("/")
    assert (inner / "config.toml").read_text() == "a\n" and (inner / "daemon.json").read_text() == "{}\n"
    assert root.makedirs("/etc/containerd/certs.d") == inner / "certs.d"
    assert root.unlink("/etc/containerd/config.toml") and not (inner / "config.toml").exists()
    assert files_under(outside) == []


def test_symlink_loop_is_one_line_error_and_writes_nothing(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    before_real = sorted(os.listdir("/etc/modprobe.d")) if os.path.isdir("/etc/modprobe.d") else None
    before_tree = files_under(r)
    root = Root(r)
    for call in (lambda: root.atomic_write("/etc/modprobe.d/driverd.conf", "blacklist nouveau\n"),
                 lambda: root.makedirs("/etc/modprobe.d/sub"),
                 lambda: root.write_target("/etc/modprobe.d/x.conf"),
                 lambda: root.unlink("/etc/modprobe.d/x.conf"),
                 lambda: root.write_existing("/etc/modprobe.d/x.conf", "x"),
                 lambda: root.mknod("/etc/modprobe.d/n", stat.S_IFIFO | 0o600)):
        with pytest.raises(HostPathError) as e:
            call()
        line = e.value.one_line()
        assert "\n" not in line and "/etc/modprobe.d" in line and "symbolic links" in line
        assert "fix:" in line and str(r) in line and e.value.exit_code == 3
    assert files_under(r) == before_tree and files_under(outside) == []
    after_real = sorted(os.listdir("/etc/modprobe.d")) if os.path.isdir("/etc/modprobe.d") else None
    assert after_real == before_real


def test_final_component_loop(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    os.symlink("/etc/b.conf", r / "etc/a.conf")
    os.symlink("a.conf", r / "etc/b.conf")
    with pytest.raises(HostPathError, match="symbolic links"):
        Root(r).atomic_write("/etc/a.conf", "x")
    assert os.path.islink(r / "etc/a.conf") and os.path.islink(r / "etc/b.conf")


def test_file_in_the_way_is_an_oserror_not_a_write_elsewhere(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    (r / "etc/notadir").write_text("x")
    with pytest.raises(NotADirectoryError):
        Root(r).atomic_write("/etc/notadir/f", "y")
    assert (r / "etc/notadir").read_text() == "x"


def test_atomic_write_modes_json_and_no_temp_left(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    root = Root(r)
    root.atomic_write("/etc/a", "1")
    assert stat.S_IMODE(os.stat(r / "etc/a").st_mode) == 0o644
    os.chmod(r / "etc/a", 0o640)
    root.atomic_write("/etc/a", "2")
    assert stat.S_IMODE(os.stat(r / "etc/a").st_mode) == 0o640
    root.atomic_write("/etc/a", "3", 0o600)
    assert stat.S_IMODE(os.stat(r / "etc/a").st_mode) == 0o600 and (r / "etc/a").read_text() == "3"
    obj = {"b": [1, 2], "a": {"z": None}}
    root.atomic_write_json("/var/lib/driverd/runtime/state.json", obj)
    atomic_write_json(tmp_path / "ref.json", obj)
    assert (r / "var/lib/driverd/runtime/state.json").read_bytes() == (tmp_path / "ref.json").read_bytes()
    assert json.loads((r / "var/lib/driverd/runtime/state.json").read_text()) == obj
    assert not [p for p in files_under(r) if p.endswith(".tmp")]


def test_unlink(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    root = Root(r)
    assert root.unlink("/etc/nope") is False
    assert root.unlink("/nodir/nope") is False
    with pytest.raises(FileNotFoundError):
        root.unlink("/etc/nope", missing_ok=False)
    root.atomic_write("/var/run/x.pid", "1\n")
    assert root.unlink("/var/run/x.pid") and not (r / "run/x.pid").exists()
    # rm semantics: the link goes, its target stays; follow_symlink removes the target instead
    assert root.unlink("/usr/bin/x") and not os.path.lexists(r / "usr/bin/x") and (r / "usr/bin/x.real").exists()
    assert root.unlink("/etc/alternatives/x", follow_symlink=True)
    assert os.path.islink(r / "etc/alternatives/x") and not (r / "usr/bin/x.real").exists()


def test_write_existing(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    attr = r / "sys/module/firmware_class/parameters/path"
    attr.parent.mkdir(parents=True)
    attr.write_text("\n")
    root = Root(r)
    root.write_existing("/sys/module/firmware_class/parameters/path", "/var/lib/driverd/firmware")
    assert attr.read_text() == "/var/lib/driverd/firmware"
    with pytest.raises(FileNotFoundError):
        root.write_existing("/sys/module/nope/parameters/path", "x")
    assert not (r / "sys/module/nope").exists()
    (outside / "victim").write_text("keep")
    os.symlink(str(outside / "victim"), r / "sys/module/firmware_class/parameters/link")
    with pytest.raises(HostPathError, match="symbolic link"):
        root.write_existing("/sys/module/firmware_class/parameters/link", "x")
    assert (outside / "victim").read_text() == "keep"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs CAP_MKNOD")
def test_mknod(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    os.symlink("/devices", r / "dev")
    root = Root(r)
    old = os.umask(0o077)
    try:
        root.mknod("/dev/nvidia0", 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    finally:
        os.umask(old)
    st = os.lstat(r / "devices/nvidia0")
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666 and os.major(st.st_rdev) == 195
    with pytest.raises(FileExistsError):
        root.mknod("/dev/nvidia0", 0o666 | stat.S_IFCHR, os.makedev(195, 0))


def test_write_target_never_returns_a_path_through_a_link(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    root = Root(r)
    for hp, want in (("/var/run/driverd/x.sock", "run/driverd/x.sock"), ("/lib/modules/k/build", "usr/lib/modules/k/build"),
                     ("/etc/cdi/nvidia.yaml", "run/cdi/nvidia.yaml")):
        got = root.write_target(hp)
        assert got == r / want
        cur = r
        for part in got.relative_to(r).parts[:-1]:
            cur = cur / part
            assert cur.is_dir() and not cur.is_symlink()


def test_openat2_and_walk_agree_with_the_reader(tmp_path, monkeypatch):
    if not root_mod.openat2_available():
        pytest.skip("this kernel has no openat2")
    r, outside = real_root_tree(tmp_path)
    for d in ("run/cdi", "usr/lib/modules/k", "usr/share", str(outside).lstrip("/")):
        (r / d).mkdir(parents=True, exist_ok=True)
    root = Root(r)
    paths = ["/var/run/cdi", "/lib/modules/k", "/etc/physical", "/etc/containerd", "/etc/docker", "/etc/cdi",
             "/bin/..", "/var/run/../lib", "/etc/alternatives", "/"]
    for hp in paths:
        a = root._open_dir(hp)                         # openat2
        wfd, walked = root._walk(hp)
        try:
            sa, sb = os.fstat(a), os.fstat(wfd)
            assert (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino), hp
            assert root._hostpath_of(a, hp) == walked, hp
            if ".." not in hp:                              # the reader resolves the same way
                assert walked == root.resolve(hp), hp
        finally:
            os.close(a)
            os.close(wfd)
        # what callers pass is normalised first, exactly as the readers do ('/bin/..' is '/')
        assert root.makedirs(hp) == root.real(hp), hp
    for hp in ("/etc/modprobe.d", "/etc/modprobe.d/x"):
        with pytest.raises(OSError) as e1:
            root._open_dir(hp)
        with pytest.raises(OSError) as e2:
            root._walk(hp)
        assert e1.value.errno == e2.value.errno == errno.ELOOP


def test_kernel_without_openat2_falls_back(tmp_path, monkeypatch):
    def enosys(*a, **k):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(root_mod, "_openat2", enosys)
    monkeypatch.setattr(root_mod, "_openat2_probe", None)
    monkeypatch.setattr(root_mod, "OPENAT2", None)
    assert not root_mod.openat2_available()
    r, _ = real_root_tree(tmp_path)
    Root(r).atomic_write("/var/run/cdi/nvidia.yaml", "x")
    assert (r / "run/cdi/nvidia.yaml").read_text() == "x"


def test_odd_names_are_refused_not_truncated(tmp_path, mode):
    r, _ = real_root_tree(tmp_path)
    root = Root(r)
    with pytest.raises(ValueError):
        root.atomic_write("/etc/a\0/b", "x")
    with pytest.raises(IsADirectoryError):
        root.atomic_write("/", "x")
    root.atomic_write(Path("/etc/pathlike.conf"), "ok")        # os.PathLike host paths work too
    assert (r / "etc/pathlike.conf").read_text() == "ok"
    assert not (r / "etc/a").exists()


# -- issue 30: the confined primitives for driverd's own trees (cache, kept store, staging) ---------

def test_open_write_resolves_parents_inside_and_refuses_a_final_link(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    old = os.umask(0o077)
    try:
        with root.open_write("/etc/docker/cache/p.part") as f:          # etc/docker climbs out with ../
            f.write(b"ab")
    finally:
        os.umask(old)
    inner = r / str(outside).lstrip("/")
    assert (inner / "cache/p.part").read_bytes() == b"ab"
    assert stat.S_IMODE(os.stat(inner / "cache/p.part").st_mode) == 0o644       # exactly, whatever the umask
    with root.open_write("/etc/docker/cache/p.part", append=True) as f:
        f.write(b"cd")
    assert (inner / "cache/p.part").read_bytes() == b"abcd"
    with pytest.raises(FileExistsError):
        root.open_write("/etc/docker/cache/p.part", exclusive=True)
    (outside / "target").write_text("outside\n")
    os.symlink(str(outside / "target"), inner / "cache/link")
    with pytest.raises(HostPathError, match="is a symbolic link") as e:
        root.open_write("/etc/docker/cache/link")
    assert "\n" not in e.value.one_line()
    os.mkfifo(inner / "cache/fifo")
    with pytest.raises((HostPathError, OSError)):
        root.open_write("/etc/docker/cache/fifo")
    assert (outside / "target").read_text() == "outside\n" and files_under(outside) == ["target"]


def test_rename_mkdir_rmdir_lstat(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    assert root.mkdir("/var/lib/driverd/packages", 0o700) is True
    assert stat.S_IMODE(os.stat(r / "var/lib/driverd/packages").st_mode) == 0o700
    assert root.mkdir("/var/lib/driverd/packages", 0o700, exist_ok=True) is False
    with pytest.raises(FileExistsError):
        root.mkdir("/var/lib/driverd/packages")
    os.symlink(str(outside), r / "var/lib/driverd/link")
    with pytest.raises(FileExistsError):
        root.mkdir("/var/lib/driverd/link", exist_ok=True)              # a link is no directory of ours
    root.atomic_write("/var/lib/driverd/packages/a", "1")
    root.rename("/var/lib/driverd/packages/a", "/etc/containerd/b")   # dst parent: a link resolved inside
    assert (r / str(outside).lstrip("/") / "b").read_text() == "1"
    root.rename("/var/lib/driverd/link", "/var/lib/driverd/moved")    # the link itself moves
    assert os.readlink(r / "var/lib/driverd/moved") == str(outside)
    assert root.lstat("/var/lib/driverd/moved") is not None and stat.S_ISLNK(root.lstat("/var/lib/driverd/moved").st_mode)
    assert root.lstat("/var/lib/driverd/nothing/x") is None and not root.lexists("/var/lib/driverd/nothing")
    assert root.rmdir("/var/lib/driverd/packages") is True and root.rmdir("/var/lib/driverd/packages") is False
    t = root.mkdtemp("/var/cache/driverd", ".driverd-staging-", 0o750)
    assert t.startswith("/var/cache/driverd/.driverd-staging-") and stat.S_IMODE(os.stat(root.path(t)).st_mode) == 0o750
    assert files_under(outside) == []


def test_rmtree_never_follows_a_link(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    (outside / "keep").mkdir()
    (outside / "keep/file").write_text("x")
    root = Root(r)
    d = r / "var/lib/driverd/tree"
    (d / "sub").mkdir(parents=True)
    (d / "sub/f").write_text("1")
    os.symlink(str(outside / "keep"), d / "sub/abs")
    os.symlink("../" * 14 + str(outside / "keep").lstrip("/"), d / "rel")
    assert root.rmtree("/var/lib/driverd/tree") is True and not d.exists()
    os.symlink(str(outside / "keep"), r / "var/lib/driverd/final")
    assert root.rmtree("/var/lib/driverd/final") is True                # the link goes, not its target
    assert not os.path.lexists(r / "var/lib/driverd/final")
    assert root.rmtree("/var/lib/driverd/none") is False
    (r / str(outside).lstrip("/") / "victim").mkdir(parents=True)
    assert root.rmtree("/etc/containerd/victim") is True                # through a parent link: inside
    assert files_under(outside) == ["keep", "keep/file"]


def test_link_or_copy_utime_chmod_fsync(tmp_path, mode, monkeypatch):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    root.atomic_write("/var/lib/driverd/src", b"data", 0o640)
    root.link_or_copy("/var/lib/driverd/src", "/var/lib/driverd/hard")
    assert (r / "var/lib/driverd/hard").samefile(r / "var/lib/driverd/src")
    real_link = os.link

    def exdev(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")
    monkeypatch.setattr(os, "link", exdev)
    root.link_or_copy("/var/lib/driverd/src", "/etc/containerd/copy")      # copied, inside the root
    copy = r / str(outside).lstrip("/") / "copy"
    assert copy.read_bytes() == b"data" and stat.S_IMODE(copy.stat().st_mode) == 0o640
    monkeypatch.setattr(os, "link", real_link)
    (outside / "secret").write_text("s")
    os.symlink(str(outside / "secret"), r / "var/lib/driverd/sl")
    with pytest.raises(OSError):
        root.link_or_copy("/var/lib/driverd/sl", "/var/lib/driverd/sl2")   # never a link to a link
    assert not os.path.lexists(r / "var/lib/driverd/sl2")
    root.utime("/var/lib/driverd/src", (1000, 1000))
    assert os.stat(r / "var/lib/driverd/src").st_mtime == 1000
    root.utime("/var/lib/driverd/sl", (5, 5))                              # the link's own times
    assert os.stat(outside / "secret").st_mtime != 5
    for fn in (lambda: root.chmod("/var/lib/driverd/sl", 0o600), lambda: root.fsync("/var/lib/driverd/sl")):
        with pytest.raises(HostPathError, match="is a symbolic link"):
            fn()
    root.chmod("/var/lib/driverd/src", 0o600)
    assert stat.S_IMODE(os.stat(r / "var/lib/driverd/src").st_mode) == 0o600
    root.fsync("/var/lib/driverd/src")
    root.fsync_tree("/var/lib/driverd")                                     # walks past the link
    with root.at("/etc/containerd/x") as (dfd, leaf):
        assert leaf == "x" and os.path.samefile(f"/proc/self/fd/{dfd}", r / str(outside).lstrip("/"))
    assert sorted(files_under(outside)) == ["secret"]

def test_symlink_replaces_a_link_atomically_and_never_a_file(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    root = Root(r)
    assert root.symlink("/var/lib/driverd/driver/current", "535.261.03") is None     # parents made inside the root
    assert os.readlink(r / "var/lib/driverd/driver/current") == "535.261.03"
    assert root.symlink("/var/lib/driverd/driver/current", "550.163.01") == "535.261.03"
    assert os.readlink(r / "var/lib/driverd/driver/current") == "550.163.01"
    assert [n for n in os.listdir(r / "var/lib/driverd/driver") if n.startswith(".")] == []
    # through /etc/containerd -> <outside>: the link lands inside the root, the final name is never followed
    root.symlink("/etc/containerd/l", "/etc/passwd")
    assert os.readlink(r / str(outside).lstrip("/") / "l") == "/etc/passwd" and files_under(outside) == []
    (r / "etc/file").write_text("mine")
    with pytest.raises(FileExistsError):
        root.symlink("/etc/file", "x")
    assert (r / "etc/file").read_text() == "mine"
    # replace=False: even an existing link is someone's
    with pytest.raises(FileExistsError):
        root.symlink("/var/lib/driverd/driver/current", "x", replace=False)
    assert os.readlink(r / "var/lib/driverd/driver/current") == "550.163.01"
    assert root.symlink("/usr/local/bin/nvidia-smi", "/t", replace=False) is None


def test_rename_and_rmtree_stay_inside_and_never_follow(tmp_path, mode):
    r, outside = real_root_tree(tmp_path)
    (outside / "precious").write_text("keep")
    root = Root(r)
    root.makedirs("/var/lib/d/.staging/lib64")
    (r / "var/lib/d/.staging/lib64/libx.so.1").write_text("x")
    os.symlink(str(outside), r / "var/lib/d/.staging/lib64/out")           # a link to a directory outside
    root.rename("/var/lib/d/.staging", "/var/lib/d/550")
    assert (r / "var/lib/d/550/lib64/libx.so.1").read_text() == "x" and not (r / "var/lib/d/.staging").exists()
    root.makedirs("/var/lib/d/other")
    with pytest.raises(FileExistsError):
        root.rename("/var/lib/d/other", "/var/lib/d/550", replace=False)
    assert root.rmtree("/var/lib/d/550") and not (r / "var/lib/d/550").exists()
    assert (outside / "precious").read_text() == "keep"                     # the link went, not what it named
    assert root.rmtree("/var/lib/d/550") is False
    os.symlink(str(outside), r / "var/lib/d/link")
    assert root.rmtree("/var/lib/d/link") and (outside / "precious").exists()   # a final link: only the link
    with root.open_dir("/etc/containerd/sub", create=True) as fd:
        os.mkdir("made-here", dir_fd=fd)
    assert (r / str(outside).lstrip("/") / "sub/made-here").is_dir() and files_under(outside) == ["precious"]
