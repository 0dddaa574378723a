"""Reading every process (driverd.host.procscan: here, which files each holds open), by one process or split
over forked workers: the same answer either way, on the real /proc of this machine and on host trees; a worker
that fails or hangs has its share read by the caller; no worker where the process may not fork.

What forks runs in a fresh interpreter (`_fresh`): the test process may hold threads of session fixtures,
and a process with threads does not fork (the code under test says so itself). The fresh process counts
the workers it starts by wrapping driverd.host.forked.fork, and says as many CPUs as workers asked for."""
import json
import os
import subprocess
import sys
import time

import pytest

from driverd.sim.hosttree import HostSpec, Module, Proc, h100, nvidia_version_line, write_host

HOLD = ("import os, sys, time; fds = [os.open(sys.argv[1], os.O_RDONLY) for _ in range(3)]; print(flush=True); "
        "time.sleep(300)")

PRELUDE = """
import json, os, sys, time
from driverd.host import forked, procscan
from driverd.host.processes import pids
from driverd.root import Root
def holding(path):
    return lambda root, pid: [t for t in root.link_targets(f"/proc/{pid}/fd").values() if t == path] or None
procscan._cpus = lambda: 16
real_fork = forked.fork
started = []
def counting(fn):
    child = real_fork(fn)
    started.append(child.pid)
    return child
forked.fork = counting
def reaped():
    for pid in started:
        try:
            os.waitpid(pid, os.WNOHANG)
            return False
        except ChildProcessError:
            pass
    return True
"""


def _fresh(body: str, *args: str, env: dict | None = None) -> dict:
    r = subprocess.run([sys.executable, "-c", PRELUDE + body, *args], capture_output=True, text=True, timeout=120,
                       cwd="/", env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def holders(tmp_path):
    """24 processes of this machine holding a file of the test's open (3 descriptors each), and 8 holding
    another file: the file and the holders' PIDs."""
    mine, other = tmp_path / "held", tmp_path / "other"
    mine.write_text("x")
    other.write_text("y")
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(mine if i < 24 else other)], stdout=subprocess.PIPE)
             for i in range(32)]
    try:
        for p in procs:
            p.stdout.readline()                 # its files are open
        yield str(mine), {p.pid for p in procs[:24]}
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def test_workers_and_one_process_read_the_same_on_the_live_proc(holders):
    path, mine = holders
    got = _fresh("""
root, path = Root("/"), sys.argv[1]
every = pids(root)
procscan.PER_WORKER = 10**6
alone = procscan.each_process(root, every, holding(path))
assert not started
procscan.PER_WORKER = max(1, len(every) // 4)
split = procscan.each_process(root, every, holding(path))
print(json.dumps({"alone": alone, "split": split, "order": list(split), "workers": len(started), "reaped": reaped()}))
""", path)
    assert {int(p) for p in got["alone"]} == mine and all(t == [path] * 3 for t in got["alone"].values())
    assert got["workers"] >= 2 and got["reaped"]
    assert got["split"] == got["alone"] and got["order"] == sorted(got["order"], key=int)


def test_a_failing_or_hanging_worker_has_its_share_read_by_the_caller(holders):
    path, mine = holders
    got = _fresh("""
root, path = Root("/"), sys.argv[1]
every = pids(root)
procscan.PER_WORKER = max(1, len(every) // 4)
procscan.WORKER_TIMEOUT_S = 1.0
def faulty(fn):
    n = len(started)
    return counting((lambda: os._exit(3)) if n == 0 else (lambda: time.sleep(60)) if n == 1 else fn)
forked.fork = faulty
t = time.monotonic()
found = procscan.each_process(root, every, holding(path))
print(json.dumps({"found": found, "took": time.monotonic() - t, "workers": len(started), "reaped": reaped()}))
""", path)
    assert {int(p) for p in got["found"]} == mine
    assert got["workers"] >= 2 and got["reaped"] and got["took"] < 20


def test_no_worker_where_the_process_has_threads_or_few_processes(holders):
    path, mine = holders
    got = _fresh("""
import threading
root, path = Root("/"), sys.argv[1]
every = pids(root)
procscan.PER_WORKER = len(every) + 1          # fewer processes than one worker's share
few = procscan.each_process(root, every, holding(path))
workers_few = len(started)
procscan.PER_WORKER = 1
stop = threading.Event()
other = threading.Thread(target=stop.wait)
other.start()
threaded = procscan.each_process(root, every, holding(path))
stop.set()
other.join()
print(json.dumps({"few": few, "workers_few": workers_few, "threaded": threaded, "workers": len(started)}))
""", path)
    assert {int(p) for p in got["few"]} == mine and got["threaded"] == got["few"]
    assert got["workers_few"] == 0 and got["workers"] == 0


def test_gpu_users_and_daemons_on_a_host_tree_are_the_same_read_by_workers(tmp_path):
    """A host tree of 600 processes, every fifth holding NVIDIA device files among others, two of them GPU
    daemons (one holding nothing): the users and the daemons of one pass, read alone and by workers."""
    procs = [Proc(1000 + i, f"worker{i}", (("/dev/nvidiactl", f"/dev/nvidia{i % 8}") if i % 5 == 0 else ())
                  + ("/dev/null", f"/tmp/f{i}", "socket:[123]"), cmdline=f"python3 rank{i}.py") for i in range(600)]
    procs += [Proc(2000, "nvidia-persistenced", ("/dev/nvidiactl", "/dev/nvidia0")), Proc(2001, "nv-fabricmanager")]
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0", "nvidia")], modules=[Module("nvidia", refcount=2)],
                                  nvidia_version_text=nvidia_version_line("570.195.03", "open"), procs=procs))
    got = _fresh("""
from driverd.host.processes import scan
root = Root(sys.argv[1])
def both():
    users, daemons = scan(root, skip=(1005,))
    return [[u.pid, u.comm, u.cmdline, list(u.devices)] for u in users], [[d.name, list(d.pids)] for d in daemons]
procscan.PER_WORKER = 10**6
alone = both()
procscan.PER_WORKER = 50
split = both()
print(json.dumps({"alone": alone, "split": split, "workers": len(started), "reaped": reaped()}))
""", str(tmp_path))
    assert got["workers"] >= 2 and got["reaped"]
    assert got["split"] == got["alone"]
    users, daemons = got["alone"]
    assert [u[0] for u in users] == [1000 + i for i in range(0, 600, 5) if i != 5] + [2000]
    assert users[1] == [1010, "worker10", "python3 rank10.py", ["/dev/nvidia2", "/dev/nvidiactl"]]
    assert dict((n, p) for n, p in daemons) == {"nvidia-persistenced": [2000], "nv-fabricmanager": [2001],
                                                "nvlsm": [], "nvidia-imex": []}


def test_a_forked_child_holds_none_of_the_callers_files_nor_its_signal_handlers(tmp_path):
    """driverd.host.forked: the child closes every descriptor of the caller's but its pipe (a host lock
    held by the caller is not held on by a child left waiting) and takes the default action on SIGTERM
    (the caller's handler, Ctrl-C's clean-up, is not the child's); a child that fails is said so."""
    held = tmp_path / "lock"
    held.write_text("")
    got = _fresh("""
import signal
fd = os.open(sys.argv[1], os.O_RDONLY)
seen = []
signal.signal(signal.SIGTERM, lambda *a: seen.append(1))
def files():
    return sorted(os.readlink(f"/proc/self/fd/{n}") for n in os.listdir("/proc/self/fd")
                  if int(n) > 2 and os.path.exists(f"/proc/self/fd/{n}"))
child_files = forked.fork(files).answer(30)
ready = sys.argv[1] + ".ready"
def wait_ready():                       # the child's function runs once its signals are the defaults
    open(ready, "w").close()
    time.sleep(60)
waiting = forked.fork(wait_ready)
deadline = time.monotonic() + 60        # however busy the machine, SIGTERM goes to a child that is ready
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(waiting.pid, signal.SIGTERM)
out = {"child_files": child_files, "mine": files()}
for name, child in (("terminated", waiting), ("failing", forked.fork(lambda: 1 / 0)),
                    ("unsendable", forked.fork(lambda: object()))):
    try:
        out[name] = child.answer(30)
    except forked.ChildFailed as e:
        out[name] = "failed: " + str(e)
hung = forked.fork(lambda: time.sleep(60))
t = time.monotonic()
try:
    hung.answer(0.5)
except forked.ChildFailed as e:
    out["hung"] = "failed: " + str(e)
out["hung_took"] = time.monotonic() - t
out["seen"], out["reaped"] = seen, reaped()
print(json.dumps(out))
""", str(held))
    assert str(held) in got["mine"] and str(held) not in got["child_files"]
    assert got["terminated"] == "failed: killed by signal 15" and not got["seen"]
    assert got["failing"] == "failed: exit status 1"
    assert got["hung"] == "failed: no answer in 0.5 s" and got["hung_took"] < 10
    assert got["unsendable"] == "failed: exit status 1"
    assert got["reaped"]


# detect starts the pass over every process in a child before it reads its configuration (driverd.host.
# start_early), like NVML's: on a busy node the pass is tens of thousands of reads. On this machine's real
# /proc, a process named as a GPU daemon (a copy of sleep called nvlsm) must be found, from that child.

DETECT = """
import contextlib, io, sys, psutil
from driverd.host import processes
forks, given = [], []
def recording(fn):
    forks.append({"fn": fn.__qualname__, "config_read": "driverd.config" in sys.modules,
                  "command_line_read": "driverd.cli" in sys.modules})
    return (counting(lambda: 1 / 0) if os.environ.get("FAIL_EARLY") and len(forks) == 1 else
            counting((lambda: time.sleep(120)) if os.environ.get("HANG_EARLY") and len(forks) == 1 else fn))
forked.fork = recording
scan = processes.scan
def scanning(*a, **kw):
    given.append(kw.get("seen") is not None)
    return scan(*a, **kw)
processes.scan = scanning
out = io.StringIO()
t = time.monotonic()
with contextlib.redirect_stdout(out):
    if os.environ.get("CONSOLE_SCRIPT"):
        # the console script, whole; its exit taken from the test side, to report from here
        import driverd.__main__ as script
        me, real_exit = os.getpid(), os._exit
        def leave(code):
            if os.getpid() != me:
                real_exit(code)         # a forked child's own exit
            raise SystemExit(code)
        os._exit, sys.argv = leave, ["driverd", *sys.argv[1:]]
        try:
            script.entry()
        except SystemExit as e:
            rc = e.code
    else:
        from driverd.cli import main
        rc = main(sys.argv[1:])
took = time.monotonic() - t
facts = json.loads(out.getvalue()) if rc == 0 and out.getvalue().startswith("{") else None  # not help
print(json.dumps({"rc": rc, "took": took, "forks": forks, "given": given, "reaped": reaped(),
                  "children": len(psutil.Process().children()),
                  "nvlsm": facts and [d["pids"] for d in facts["daemons"] if d["name"] == "nvlsm"][0]}))
"""


@pytest.fixture
def nvlsm(tmp_path):
    """A process of this machine whose name is a GPU daemon's (nvlsm): its pid."""
    import shutil
    exe = tmp_path / "nvlsm"
    shutil.copy(shutil.which("sleep"), exe)
    p = subprocess.Popen([str(exe), "300"])
    try:
        time.sleep(0.2)
        yield p.pid
    finally:
        p.kill()
        p.wait()


def _detect(*argv: str, env: dict | None = None) -> dict:
    return _fresh(DETECT, *argv, env=env)


def test_detect_reads_every_process_in_a_child_started_before_its_configuration(nvlsm):
    got = _detect("detect", "--json", "--no-nvml")
    assert got["rc"] == 0 and nvlsm in got["nvlsm"]
    early = got["forks"][0]
    assert early["fn"].startswith("_start_reading") and not early["config_read"], got["forks"]
    assert got["given"] == [True]                     # the facts took the child's pass, not one of their own
    assert got["reaped"] and got["children"] == 0


def test_a_failed_early_pass_is_read_again_and_a_failed_detect_leaves_none(nvlsm, tmp_path):
    got = _detect("detect", "--json", "--no-nvml", env={"FAIL_EARLY": "1"})
    assert got["rc"] == 0 and nvlsm in got["nvlsm"] and got["given"] == [False]   # read here: nothing lost
    assert got["reaped"] and got["children"] == 0
    bad = tmp_path / "config.toml"
    bad.write_text("[runtime\n")
    got = _detect("detect", "--json", "--no-nvml", "--config", str(bad), env={"HANG_EARLY": "1"})
    assert got["rc"] == 2 and got["forks"] and got["took"] < 60       # a pass that hangs (120 s) does not hold it
    assert got["reaped"] and got["children"] == 0


def test_the_console_script_starts_the_pass_before_it_reads_the_command_line(nvlsm, tmp_path):
    got = _detect("detect", "--json", "--no-nvml", env={"CONSOLE_SCRIPT": "1"})
    assert got["rc"] == 0 and nvlsm in got["nvlsm"]
    assert len(got["forks"]) == 1 and not got["forks"][0]["command_line_read"], got["forks"]
    assert got["given"] == [True] and got["reaped"] and got["children"] == 0
    # help, a usage error, another root: whatever started is gone when the command is; off the live root
    # nothing is started before the command line is read, and the pass is the tree's
    # (the last looks plain, so the pass starts, and argparse refuses it)
    for argv, started in ((("detect", "--help"), False), (("detect", "--json", "--bogus"), False),
                          (("detect", "-o", "json", "-o"), True)):
        got = _detect(*argv, env={"CONSOLE_SCRIPT": "1"})
        assert got["rc"] in (0, 2) and bool(got["forks"]) == started, (argv, got)
        assert got["reaped"] and got["children"] == 0, (argv, got)
    tree = tmp_path / "tree"
    write_host(tree, HostSpec(procs=[Proc(100, "nvlsm")]))
    for argv, env in ((("detect", "--json", "--root", str(tree)), {}),
                      (("detect", "--json"), {"DRIVERD_ROOT": str(tree)})):
        got = _detect(*argv, env={"CONSOLE_SCRIPT": "1", **env})
        assert got["rc"] == 0 and got["forks"] == [] and got["nvlsm"] == [100], (argv, got)


def test_children_started_for_the_live_root_are_dismissed_for_another():
    """start_early called again once its children run (the console script started them before the command
    line was read): the same root keeps them, another root dismisses them."""
    got = _fresh("""
import driverd.host as host
first = host.start_early("/")
child = host._started.reading
again = host.start_early("/")
kept = host._started.reading is child and again is not None
other = host.start_early("/srv/tree")
print(json.dumps({"first": first is not None, "kept": kept, "other": other, "gone": host._started.reading is None,
                  "reaped": reaped()}))
""")
    assert got == {"first": True, "kept": True, "other": None, "gone": True, "reaped": True}


def test_no_early_pass_off_the_live_root(tmp_path):
    tree = tmp_path / "tree"
    write_host(tree, HostSpec(procs=[Proc(100, "nvlsm")]))
    got = _detect("detect", "--json", "--root", str(tree))
    assert got["rc"] == 0 and got["forks"] == [] and got["given"] == [False] and got["nvlsm"] == [100]


def test_the_early_pass_imports_neither_the_facts_classes_nor_dataclasses():
    """What the early child imports is on its path (on a busy node it was the last to answer): the pass
    needs the root and driverd.host.processes, not the facts' classes."""
    code = ("import json, sys; from driverd.host import _read_all; before = set(sys.modules); "
            "seen = _read_all('/'); print(json.dumps([sorted(set(sys.modules) - before), len(seen)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    added, _ = json.loads(r.stdout)
    assert "driverd.host.processes" in added and "driverd.root" in added
    assert not {"dataclasses", "driverd.host.facts", "driverd.config", "typing", "inspect"} & set(added), added


def test_a_pass_answer_of_another_shape_is_none_and_read_again():
    """answer_of (the workers' and the early child's answers alike): what is not pid -> what the pass keeps
    is no answer, so the caller reads those processes itself."""
    got = _fresh("""
import driverd.host as host
from driverd.host.procscan import answer_of
out = {}
for name, made in (("good", {"7": [None, ["/dev/nvidia0"]]}), ("list", [1, 2]), ("pid", {"x": [None, []]}),
                   ("short", {"7": [None]}), ("failed", None)):
    child = forked.fork((lambda made=made: made) if made is not None else (lambda: 1 / 0))
    out[name] = answer_of(child, host._comm_and_devices)
print(json.dumps({"out": out, "reaped": reaped()}))
""")
    assert got["out"] == {"good": {"7": [None, ["/dev/nvidia0"]]}, "list": None, "pid": None, "short": None,
                          "failed": None}
    assert got["reaped"]
