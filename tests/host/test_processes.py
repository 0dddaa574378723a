import pytest

from driverd.host import collect
from driverd.host.processes import container_of
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, Proc, h100, nvidia_version_line, write_host

CID = "4f6b" * 16


@pytest.mark.parametrize("cgroup,ctr,pod", [
    # cgroup v2, systemd driver (kubelet + containerd)
    (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod6a2b1c3d_9e8f_4a5b_8c7d_112233445566.slice/cri-containerd-{CID}.scope",
     CID, "6a2b1c3d-9e8f-4a5b-8c7d-112233445566"),
    # cgroup v1, cgroupfs driver
    (f"12:devices:/kubepods/burstable/pod6a2b1c3d-9e8f-4a5b-8c7d-112233445566/{CID}\n11:memory:/kubepods/burstable/pod6a2b1c3d-9e8f-4a5b-8c7d-112233445566/{CID}",
     CID, "6a2b1c3d-9e8f-4a5b-8c7d-112233445566"),
    # CRI-O
    (f"0::/kubepods.slice/kubepods-pod6a2b1c3d_9e8f_4a5b_8c7d_112233445566.slice/crio-{CID}.scope",
     CID, "6a2b1c3d-9e8f-4a5b-8c7d-112233445566"),
    # plain docker, no pod
    (f"0::/system.slice/docker-{CID}.scope", CID, None),
    ("0::/user.slice/user-1000.slice/session-3.scope", None, None),
])
def test_container_and_pod_from_cgroup(cgroup, ctr, pod):
    assert container_of(cgroup) == (ctr, pod)


def test_gpu_users_and_daemons(tmp_path):
    write_host(tmp_path, HostSpec(
        pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=2)],
        nvidia_version_text=nvidia_version_line("570.195.03", "open"),
        procs=[Proc(100, "python3", ("/dev/nvidia0", "/dev/nvidiactl", "/tmp/x"), cmdline="python3 train.py"),
               Proc(200, "bash", ("/dev/null",)), Proc(300, "nvidia-persistenced", ("/dev/nvidiactl",))]))
    f = collect(Root(tmp_path), nvml=False)
    users = {u.pid: u for u in f.gpu_users}
    assert set(users) == {100, 300}
    assert users[100].devices == ("/dev/nvidia0", "/dev/nvidiactl") and users[100].cmdline == "python3 train.py"
    assert f.daemon("nvidia-persistenced").pids == (300,)
    assert not f.daemon("nv-fabricmanager").running


def test_names_the_kernel_cut_at_15_characters_are_read_whole(tmp_path):
    """/proc/PID/comm holds 15 characters (TASK_COMM_LEN): `nvidia-persiste`. The whole name comes from
    argv[0] or /proc/PID/exe when it starts with the cut one; a process that rewrote its argv keeps comm."""
    import os
    write_host(tmp_path, HostSpec(
        pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=4)],
        nvidia_version_text=nvidia_version_line("570.195.03", "open"), procs=[
        Proc(300, "nvidia-persistenced", ("/dev/nvidiactl",), cmdline="/usr/bin/nvidia-persistenced --verbose"),
        Proc(301, "nv-fabricmanager", ("/dev/nvidia-nvswitchctl",), cmdline=" "),       # empty argv: exe says
        Proc(302, "a-training-worker", ("/dev/nvidia0",), cmdline="renamed: worker 3"),  # argv rewritten
        Proc(303, "python3", ("/dev/nvidia1",), cmdline="python3 train.py")]))
    os.symlink("/opt/nvidia/bin/nv-fabricmanager", tmp_path / "proc/301/exe")
    (tmp_path / "proc/301/cmdline").write_bytes(b"")
    from driverd.host.processes import gpu_users
    names = {u.pid: u.comm for u in gpu_users(Root(tmp_path))}
    assert (tmp_path / "proc/300/comm").read_text() == "nvidia-persiste\n"          # what the kernel shows
    assert names == {300: "nvidia-persistenced", 301: "nv-fabricmanager", 302: "a-training-work", 303: "python3"}
    r = __import__("tests.conftest", fromlist=["run_cli"]).run_cli("detect", "--root", str(tmp_path))
    assert "gpu user    pid 300 nvidia-persistenced" in r.stdout and "nvidia-persiste " not in r.stdout


def test_the_nvml_query_child_is_no_gpu_user(tmp_path):
    """detect's own NVML query holds /dev/nvidia* while it asks: it is left out (plan would otherwise block
    an unload on 'the GPU is in use by' driverd itself)."""
    from driverd.host import processes
    write_host(tmp_path, HostSpec(
        pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=2)],
        nvidia_version_text=nvidia_version_line("570.195.03", "open"),
        procs=[Proc(100, "python3", ("/dev/nvidia0",)), Proc(4242, "driverd", ("/dev/nvidiactl", "/dev/nvidia0"))]))
    assert {u.pid for u in processes.gpu_users(Root(tmp_path))} == {100, 4242}
    assert {u.pid for u in processes.gpu_users(Root(tmp_path), skip=(4242,))} == {100}
    assert {u.pid for u in processes.gpu_users(Root(tmp_path), skip=(None,))} == {100, 4242}


def test_collect_leaves_its_own_nvml_child_out_of_the_gpu_users(tmp_path, monkeypatch):
    import driverd.host as host
    from driverd.host.facts import NvmlFacts
    from driverd.host.nvml import Asked
    write_host(tmp_path, HostSpec(
        pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=2)],
        nvidia_version_text=nvidia_version_line("570.195.03", "open"),
        procs=[Proc(100, "python3", ("/dev/nvidia0",)), Proc(4242, "driverd", ("/dev/nvidiactl",))]))
    # the child a live root would start, as it looks from here: its pid, and its report when asked
    monkeypatch.setattr(host, "_nvml_early", lambda root: Asked(4242, lambda: NvmlFacts(True, None, "live")))
    f = collect(Root(tmp_path))
    assert [u.pid for u in f.gpu_users] == [100] and f.nvml.source == "live"


def test_open_files_are_read_from_the_live_proc_by_their_links(tmp_path):
    """The real /proc: a file this process opens is among its fd links, named by its target."""
    import os
    f = tmp_path / "held"
    f.write_text("x")
    fd = os.open(f, os.O_RDONLY)
    try:
        links = Root("/").link_targets(f"/proc/{os.getpid()}/fd")
        assert links[str(fd)] == str(f)
    finally:
        os.close(fd)


def test_a_process_fd_directory_that_leads_out_of_the_tree_is_not_read(tmp_path):
    """A captured (or hostile) tree whose /proc/PID/fd is a link to a directory outside it: the link is
    resolved inside the tree, so the outside directory's links are never listed; regular files among a
    directory's entries are no links; a capture records each link it reads."""
    import os
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink("/dev/nvidia0", outside / "3")
    host = tmp_path / "host"
    write_host(host, HostSpec(
        pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=2)],
        nvidia_version_text=nvidia_version_line("570.195.03", "open"),
        procs=[Proc(100, "python3", ("/dev/nvidia0", "/dev/null")), Proc(200, "evil", ())]))
    os.rmdir(host / "proc/200/fd")
    os.symlink(str(outside), host / "proc/200/fd")
    (host / "proc/100/fd/9").write_text("not a link")
    root = Root(host)
    assert root.link_targets("/proc/200/fd") == {}
    assert sorted(root.link_targets("/proc/100/fd").values()) == ["/dev/null", "/dev/nvidia0"]
    from driverd.host.processes import gpu_users
    assert [u.pid for u in gpu_users(root)] == [100]
    rec = Root(host, record=True)
    assert sorted(rec.link_targets("/proc/100/fd").values()) == ["/dev/null", "/dev/nvidia0"]
    assert {"/proc/100/fd/3", "/proc/100/fd/4"} <= rec.recorded


def test_a_pass_made_earlier_names_gpu_users_only_where_they_are_asked_for(tmp_path):
    """collect() takes the pass its early child made (device nodes held and daemon names, read whether the
    driver is loaded or not); with the driver not loaded the facts name no GPU users from it, as a pass of
    their own (daemon names only) would not."""
    from driverd.host import processes
    write_host(tmp_path, HostSpec(procs=[Proc(100, "python3", ("/dev/nvidia0",)), Proc(200, "nvlsm")]))
    root = Root(tmp_path)
    seen = {100: (None, ["/dev/nvidia0"]), 200: ("nvlsm", [])}
    users, daemons = processes.scan(root, users=False, seen=seen)
    assert users == [] and dict((d.name, d.pids) for d in daemons)["nvlsm"] == (200,)
    assert processes.scan(root, users=False) == (users, daemons)
    users, _ = processes.scan(root, seen=seen)
    assert [(u.pid, u.comm, u.devices) for u in users] == [(100, "python3", ("/dev/nvidia0",))]
