"""The daemon asks NVML in a short-lived child process (libnvidia-ml keeps ~20 MB resident after
nvmlShutdown for the life of the process that loaded it): the child's report is the in-process one."""
import json

from driverd.host import nvml
from driverd.root import Root


def test_child_report_equals_in_process_report():
    direct = nvml.read_nvml(Root("/"), True)
    nvml.query_in_child(True)
    try:
        child = nvml.read_nvml(Root("/"), True)
    finally:
        nvml.query_in_child(False)
    # On a machine without a GPU both say why NVML is unavailable, in the same words; on a GPU host
    # both list the same devices.
    assert (child.available, child.reason, child.devices) == (direct.available, direct.reason, direct.devices)
    assert "query process failed" not in (child.reason or "")


def test_captured_tree_is_never_asked_in_a_child(tmp_path):
    nvml.query_in_child(True)
    try:
        f = nvml.read_nvml(Root(str(tmp_path)), True)
    finally:
        nvml.query_in_child(False)
    assert not f.available and "not the live host" in f.reason


def test_the_child_imports_only_what_the_report_needs():
    """Issue 47: detect asks NVML in a child on another core; what that child imports is its whole
    cost, so it must not pull in the facts' classes (dataclasses), typing or driverd's other modules."""
    import json
    import subprocess

    from driverd.runner import CHILD_CWD, python_child
    argv = python_child("driverd.host.nvml", site_modules=("pynvml",))
    # the same child, asked which modules it holds once its report is printed
    argv[argv.index("-c") + 1] += "; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(argv, capture_output=True, text=True, cwd=CHILD_CWD, check=True).stdout.splitlines()
    report, modules = json.loads(out[0]), set(json.loads(out[1]))
    assert "available" in report and "reason" in report
    heavy = {"dataclasses", "typing", "inspect", "pathlib", "driverd.host.facts", "driverd.root", "site"}
    assert not heavy & modules, heavy & modules
    assert {m for m in modules if m.startswith("driverd")} <= {"driverd", "driverd.host", "driverd.host.nvml"}


# The forked child (issue 47): a process with one thread forks for NVML's report. What the child does is
# steered from the test side: report() is replaced before the fork and the child runs the replacement.
# Each case runs in a fresh interpreter, which has one thread whatever other tests left running here.

def _in_fresh_process(setup: str, call: str = "nvml.start_child()()") -> dict:
    import textwrap
    code = textwrap.dedent("""
        import dataclasses, json, os, psutil, signal, sys, threading, time
        from driverd.host import nvml
        parent = os.getpid()
        """) + textwrap.dedent(setup) + textwrap.dedent(f"""
        started = time.monotonic()
        f = {call}
        print(json.dumps({{"facts": dataclasses.asdict(f), "s": time.monotonic() - started,
                          "children": len(psutil.Process().children())}}))
        """)
    return _run_fresh(code)[0]


def _run_fresh(code: str) -> tuple[dict, str]:
    """`code` in a fresh interpreter (one thread): the JSON of its last line on stdout, and its stderr."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def test_a_one_thread_process_forks_and_reads_the_childs_report():
    got = _in_fresh_process("""
        nvml.report = lambda: {"available": os.getpid() != parent, "reason": None, "driver_version": "580.1",
                               "devices": [dict(index=0, name="H200", uuid="GPU-x", pci_bus_id="0000:01:00.0",
                                                memory_total_mib=1, persistence_mode=True,
                                                mig_mode_current=False, mig_mode_pending=False)]}
        """)
    f = got["facts"]
    # available only where the report was made in another process: the fork, not this one
    assert f["available"] and f["source"] == "live" and f["driver_version"] == "580.1"
    assert f["devices"][0]["uuid"] == "GPU-x"
    assert got["children"] == 0                     # reaped: a zombie would be listed too


def test_a_process_with_threads_does_not_fork():
    got = _in_fresh_process("""
        nvml.report = lambda: {"available": True, "reason": "forked", "devices": []}
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        """)
    # a fresh interpreter ran the real report, not this process's replacement
    assert got["facts"]["reason"] != "forked" and "query process failed" not in (got["facts"]["reason"] or "")


def test_a_child_that_never_answers_is_killed_and_named():
    got = _in_fresh_process("nvml.report = lambda: time.sleep(60)", "nvml.start_child(timeout=0.5)()")
    assert got["facts"]["reason"] == "the NVML query process failed (no answer in 0.5 s)"
    assert not got["facts"]["available"] and got["s"] < 10 and got["children"] == 0


def test_a_child_killed_by_a_signal_is_named_and_runs_none_of_the_parents_handlers(tmp_path):
    mark = tmp_path / "handler-ran"
    got = _in_fresh_process(f"""
        signal.signal(signal.SIGTERM, lambda *a: open({str(mark)!r}, "w").write(str(os.getpid())))
        nvml.report = lambda: os.kill(os.getpid(), signal.SIGTERM)
        """)
    assert not mark.exists()
    assert got["facts"]["reason"] == "the NVML query process failed (killed by signal 15)"


def test_a_child_that_raises_is_named():
    got = _in_fresh_process("""
        def boom():
            raise RuntimeError("x")
        nvml.report = boom
        """)
    assert got["facts"]["reason"] == "the NVML query process failed (exit status 1)"


def test_the_forked_child_holds_none_of_the_parents_files(tmp_path):
    """A child NVML keeps waiting must not keep the parent's host lock or sockets: here a pipe's write
    end, open in the parent at the fork, reads as closed while the child still runs."""
    flag = tmp_path / "checked"
    got = _in_fresh_process(f"""
        import select
        def report():           # running until the parent has looked at its pipe
            while not os.path.exists({str(flag)!r}):
                time.sleep(0.02)
            return {{"available": False, "reason": "asked"}}
        nvml.report = report
        r, w = os.pipe()
        result = nvml.start_child()
        os.close(w)
        closed = bool(select.select([r], [], [], 60)[0]) and os.read(r, 1) == b""
        open({str(flag)!r}, "w").close()
        """, "(lambda f: dataclasses.replace(f, reason=f'{f.reason}, closed in the child: {closed}'))(result())")
    assert got["facts"]["reason"] == "asked, closed in the child: True"


# detect starts NVML's child before it reads its configuration (issue 47): the child's pynvml import and
# nvmlInit then overlap the parent's own imports. Steered from the test side as above, in a fresh
# interpreter: the driver's report file is one of the test's (so that the driver reads as loaded), and the
# child, instead of asking NVML, writes down which modules its parent held at the fork.

_LOADED = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
           "(dvs-builder@U22-I3-AM02-24-3)  Wed Oct 15 01:36:23 UTC 2025\n")


def _detect_in_fresh_process(tmp_path, *argv: str, hang: bool = False) -> dict:
    import textwrap
    version, seen = tmp_path / "version", tmp_path / "seen"
    version.write_text(_LOADED)
    code = textwrap.dedent(f"""
        import contextlib, io, json, os, sys, time, psutil
        import driverd.driver.ident
        from driverd.host import nvml
        driverd.driver.ident.VERSION_FILE = {str(version)!r}
        def report():
            with open({str(seen)!r}, "w") as f:
                json.dump(sorted(sys.modules), f)
            if {hang!r}:
                time.sleep(120)                     # an NVML call that never returns
            return {{"available": False, "reason": "asked before the configuration"}}
        nvml.report = report
        asked = []                                  # the children started, seen from this side of the fork
        start_child = nvml.start_child
        nvml.start_child = lambda *a, **kw: asked.append(start_child(*a, **kw)) or asked[-1]
        from driverd.cli import main
        out = io.StringIO()
        started = time.monotonic()
        with contextlib.redirect_stdout(out):
            rc = main({list(argv)!r})
        print(json.dumps({{"rc": rc, "out": out.getvalue(), "s": time.monotonic() - started, "asked": len(asked),
                          "children": len(psutil.Process().children())}}))
        """)
    res, res["stderr"] = _run_fresh(code)
    res["held_at_fork"] = json.loads(seen.read_text()) if seen.exists() else None
    return res


def test_detect_asks_nvml_before_it_reads_its_configuration_or_the_facts(tmp_path):
    got = _detect_in_fresh_process(tmp_path, "detect", "--json")
    assert got["rc"] == 0, got["stderr"]
    nv = json.loads(got["out"])["nvml"]
    assert got["asked"] == 1 and nv["reason"] == "asked before the configuration"   # the early child's report
    held = set(got["held_at_fork"])
    assert "driverd.host.nvml" in held
    # neither the configuration nor the facts' classes, nor what they stand on (dataclasses, the root)
    assert not held & {"driverd.config", "driverd.cli.context", "driverd.host.facts", "dataclasses",
                       "driverd.root"}, sorted(m for m in held if m.startswith("driverd"))
    assert got["children"] == 0                                       # reaped


def test_a_detect_that_fails_before_its_reads_leaves_no_child(tmp_path):
    bad = tmp_path / "config.toml"
    bad.write_text("[runtime\n")
    got = _detect_in_fresh_process(tmp_path, "detect", "--json", "--config", str(bad))
    assert got["rc"] == 2 and "is not valid TOML" in got["stderr"]
    assert got["asked"] == 1                                          # the child had started...
    assert got["children"] == 0                                       # ...and is gone


def test_a_hung_nvml_child_does_not_hold_a_failed_detect(tmp_path):
    """The child's report is not wanted once the command has failed: a child NVML keeps waiting is killed
    at once, not waited for up to its 60-s limit."""
    bad = tmp_path / "config.toml"
    bad.write_text("[runtime\n")
    got = _detect_in_fresh_process(tmp_path, "detect", "--json", "--config", str(bad), hang=True)
    assert got["rc"] == 2 and got["asked"] == 1
    assert got["s"] < 20 and got["children"] == 0, got


def test_detect_starts_no_early_child_off_the_live_root_or_without_nvml(tmp_path):
    tree = tmp_path / "tree"
    (tree / "proc").mkdir(parents=True)
    (tree / "etc").mkdir()
    (tree / "etc" / "os-release").write_text("ID=debian\n")
    got = _detect_in_fresh_process(tmp_path, "detect", "--json", "--root", str(tree))
    assert got["rc"] == 0 and got["asked"] == 0 and got["held_at_fork"] is None and got["children"] == 0
    got = _detect_in_fresh_process(tmp_path, "detect", "--json", "--no-nvml")
    assert got["rc"] == 0 and got["asked"] == 0 and got["held_at_fork"] is None
    assert json.loads(got["out"])["nvml"]["reason"] == "NVML disabled (--no-nvml)"
