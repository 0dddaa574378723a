"""`driverd build` says what it is doing while it compiles (issue 32, item 6): its phases with the
elapsed time on stderr, on a terminal a redrawn line counting the objects kbuild compiled against those
the Kbuild files name; it refuses an --out it cannot write before compiling; and a SIGTERM'd build
cleans up as Ctrl-C does — no cell tree left, no make or compiler left running.

The compiles are real: the VM tests' stand-in modules (tests/vm/standin) built by kbuild against
Debian's real 6.1 headers, a few seconds each."""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from driverd.build import progress as bp
from tests.conftest import driverd_env, missing_component, require_binary, run_cli
from tests.vm.harness import standin_source

RELEASE = "6.1.0-47-cloud-amd64"
HEADERS = Path(f"/usr/src/linux-headers-{RELEASE}")
pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@pytest.fixture
def standin(tmp_path):
    require_binary("make")
    require_binary("gcc")
    require_binary("modinfo", "/usr/sbin/modinfo")
    if not (HEADERS / "Makefile").is_file():
        missing_component(f"real component {HEADERS} is missing (bash .ci/install-components installs it)")
    return standin_source(tmp_path / "src", "535.261.03")


def _argv(src: Path, base: Path, *extra: str) -> list[str]:
    return ["build", "--source", str(src), "--kernel", RELEASE, "--flavor", "open", "--headers", str(HEADERS),
            "--work-dir", str(base / "work"), "--out", str(base / "out"), "--make-jobs", "1", *extra]


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "driverd"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]


def test_build_reports_its_phases_with_elapsed_time(standin, tmp_path):
    r = run_cli(*_argv(standin, tmp_path))
    assert r.returncode == 0, r.stderr
    cell = f"535.261.03-open-{RELEASE}-x86_64"
    lines = r.stderr.splitlines()
    said = [ln for ln in lines if ln.startswith(f"{cell}: ")]
    # one line per phase, in the order the build goes through them, each with the time so far
    order = ["copying the sources", "make -j1 modules", "running make", "compiling", "linking",
             "stripping debug info from 0/4 modules", "packing"]
    at = [next(i for i, ln in enumerate(said) if ln.startswith(f"{cell}: {w}")) for w in order]
    assert at == sorted(at), said
    assert all(ln.rstrip().endswith("s)") for ln in said if not ln.startswith(f"{cell}: make ")), said
    assert "\r" not in r.stderr and "\033[" not in r.stderr          # no redrawing into a log
    assert lines[-1].startswith("built in ") and r.stdout.strip().endswith(".tar.zst")


def test_on_a_terminal_the_compile_is_counted(standin, tmp_path):
    """stderr on a pseudo-terminal: one line redrawn in place, objects compiled / expected."""
    master, slave = pty.openpty()
    p = subprocess.Popen(_cli() + _argv(standin, tmp_path), stdout=subprocess.PIPE, stderr=slave,
                         env=driverd_env(), text=False)
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:          # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(60) == 0
    text = out.decode(errors="replace")
    assert "\r\033[K" in text
    # the stand-in's Kbuild names 4 single-file modules: 4 objects + 4 .mod.o, then 4 .ko
    drawn = text.split("\r\033[K")
    counts = [int(ln.split(": compiling ")[1].split("/")[0]) for ln in drawn if ": compiling " in ln]
    assert counts[0] == 1 and counts == sorted(counts) and counts[-1] >= 4, drawn
    assert all("/8 objects [" in ln for ln in drawn if ": compiling " in ln), drawn
    assert any(ln.startswith(f"535.261.03-open-{RELEASE}-x86_64: linking 4/4 modules [####################] (")
               for ln in drawn), drawn
    assert text.endswith("\r\nbuilt in " + text.rsplit("built in ", 1)[1]) and "packing" in drawn[-1]


def test_progress_parser_on_the_real_kbuild_log(standin, tmp_path):
    """The counts the parser makes of a real kbuild run (the build's own log) are the expected ones."""
    r = run_cli(*_argv(standin, tmp_path))
    assert r.returncode == 0, r.stderr
    (log,) = (tmp_path / "work/logs").glob("*.log")
    exp = bp.expected(standin)
    assert exp == bp.Expected(objects=8, modules=4)
    kb = bp.Kbuild(exp)
    seen = []
    for ln in log.read_text().splitlines():
        if kb.feed(ln) and kb.phase not in seen:
            seen.append(kb.phase)
    assert seen == ["compile", "link"]
    assert (kb.compiled, kb.linked) == (exp.objects, exp.modules)


def test_expected_objects_of_nvidias_kbuild_files(tmp_path):
    """NVIDIA's layout: Kbuild includes <module>/<module>.Kbuild, which list C files in *_SOURCES."""
    (tmp_path / "Kbuild").write_text("NV_KERNEL_MODULES ?= nvidia nvidia-uvm\n"
                                     "$(foreach _module, $(NV_KERNEL_MODULES), \\\n"
                                     " $(eval include $(src)/$(_module)/$(_module).Kbuild))\n")
    for mod, srcs in (("nvidia", ["nv.c", "nv-pci.c", "os-interface.c"]), ("nvidia-uvm", ["uvm.c", "uvm_va.c"])):
        (tmp_path / mod).mkdir()
        var = mod.upper().replace("-", "_") + "_SOURCES"
        body = f"{var} ?=\n" + "".join(f"{var} += {mod}/{s}\n" for s in srcs)
        (tmp_path / mod / f"{mod}.Kbuild").write_text(
            body + f"# {var} += {mod}/commented-out.c\nobj-m += {mod}.o\n{mod}-y := $({var}:.c=.o)\n")
    assert bp.expected(tmp_path) == bp.Expected(objects=5 + 2, modules=2)
    kb = bp.Kbuild(bp.expected(tmp_path))
    assert kb.feed(" CONFTEST: linux/efi.h") and kb.phase == "conftest" and kb.counts() == (1, None)
    assert not kb.feed("make[2]: Entering directory '/usr/src/linux-headers-6.1.0-47-common'")
    kb.feed("  CC [M]  /w/nvidia/nv.o")
    assert kb.phase == "compile" and kb.counts() == (1, 7)
    for _ in range(9):                   # more than expected: the total follows what was seen
        kb.feed("  CC [M]  /w/nvidia/x.o")
    assert kb.counts() == (10, 10)
    kb.feed("  LD [M]  /w/nvidia.o")      # a composite object, not a module
    assert kb.phase == "compile"
    kb.feed("  LD [M]  /w/nvidia.ko")
    assert kb.phase == "link" and kb.counts() == (1, 2)


def _processes_under(path: str) -> list[str]:
    """Processes whose command line or working directory names `path` (make, cc1, as, ld...)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (path in cmd or cwd.startswith(path)):
            found.append(f"{pid}: {cmd[:120]}")
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_the_compile_cleans_up(standin, tmp_path, sig):
    """SIGTERM (systemctl stop, docker stop, kill) as SIGINT: the cell's tree is removed, make and its
    compilers are stopped, one line, exit 128+signal."""
    # Ctrl-C on a terminal: SIGINT at its default (a job a shell started with `&` — CI run that way —
    # inherits it ignored, and Python keeps it so)
    p = subprocess.Popen(_cli() + _argv(standin, tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=driverd_env(), text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    cells = tmp_path / "work" / "cells"
    err = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:          # until kbuild compiles (a compiler is running)
        line = p.stderr.readline()
        err.append(line)
        if ": compiling " in line or not line:
            break
    assert any(": compiling " in ln for ln in err), "".join(err)
    assert any(cells.iterdir()), "the build has no cell tree yet"
    assert _processes_under(str(cells)), "nothing compiles"
    t0 = time.monotonic()
    p.send_signal(sig)
    rest = p.communicate(timeout=60)[1]
    assert time.monotonic() - t0 < 15
    assert p.returncode == 128 + sig, rest
    assert rest.strip().splitlines()[-1] == ("driverd: terminated" if sig == signal.SIGTERM
                                             else "driverd: interrupted")
    assert list(cells.iterdir()) == []
    time.sleep(0.5)
    assert _processes_under(str(tmp_path)) == []
    assert not list((tmp_path / "out").glob("*.tar.zst"))


def test_unwritable_out_is_refused_before_compiling(standin, tmp_path):
    (tmp_path / "file").write_text("x")
    for out, why in ((tmp_path / "file", "it is not a directory"),
                     (tmp_path / "file" / "repo", "cannot create it: Not a directory")):
        t0 = time.monotonic()
        r = run_cli(*_argv(standin, tmp_path)[:-4], "--out", str(out))
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and f"output directory {out}: {why}" in r.stderr
        assert "fix: pass --out a directory you can write to" in r.stderr
        assert time.monotonic() - t0 < 10
        assert not (tmp_path / "work" / "cells").exists() and not (tmp_path / "work" / "sources").exists()


def test_read_only_out_is_refused_before_compiling(standin, tmp_path):
    """A read-only file system (root's case: permission bits do not stop root)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    unshare = require_binary("unshare")
    probe = subprocess.run([unshare, "-m", "sh", "-c", f"mount --bind -o ro {ro} {ro}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private read-only mount here: {probe.stderr.decode().strip()}")
    cmd = " ".join(_cli() + _argv(standin, tmp_path)[:-4] + ["--out", str(ro)])
    r = subprocess.run([unshare, "-m", "sh", "-c", f"mount --bind -o ro {ro} {ro} && exec {cmd}"],
                       capture_output=True, text=True, env=driverd_env(), timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"output directory {ro}: cannot write to it: Read-only file system" in r.stderr
    assert r.stderr.count("\n") == 1
    assert not (tmp_path / "work" / "cells").exists()


def test_with_json_the_result_is_alone_on_stdout_and_progress_on_stderr(standin, tmp_path):
    r = run_cli(*_argv(standin, tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cached"] is False
    assert ": compiling " in r.stderr
    r = run_cli(*_argv(standin, tmp_path), "--json", "--log-format", "json")
    events = [json.loads(ln) for ln in r.stderr.splitlines()]
    assert json.loads(r.stdout)["cached"] is True
    assert events[-1]["msg"].startswith(f"served from {tmp_path / 'out'} in ")


def test_build_matrix_sigterm_stops_every_cell_building_in_parallel(standin, tmp_path):
    """Two cells compiling at once in worker threads (the signal reaches the main thread only): every
    compile is stopped and every cell tree removed."""
    other = "6.1.0-47-amd64"
    if not Path(f"/usr/src/linux-headers-{other}/Makefile").is_file():
        missing_component(f"real component /usr/src/linux-headers-{other} is missing")
    matrix = tmp_path / "m.toml"
    matrix.write_text(f'jobs = 2\nmake_jobs = 1\n[[drivers]]\nversion = "535.261.03"\nflavors = ["open"]\n'
                      f'sources = {{ open = "{standin}" }}\n'
                      f'[[kernels]]\nrelease = "{RELEASE}"\n[[kernels]]\nrelease = "{other}"\n')
    p = subprocess.Popen(_cli() + ["build-matrix", str(matrix), "--out", str(tmp_path / "out"),
                                   "--work-dir", str(tmp_path / "work")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=driverd_env(), text=True)
    cells = tmp_path / "work" / "cells"
    compiling: set[str] = set()
    deadline = time.monotonic() + 120
    while len(compiling) < 2 and time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        if line.split()[1:2] == ["compile"]:            # "[0/2] compile  <cell>: compiling 1/8 objects (1s)"
            compiling.add(line.split()[2])
    assert len(compiling) == 2, compiling
    assert len(list(cells.iterdir())) == 2 and _processes_under(str(cells))
    p.send_signal(signal.SIGTERM)
    rest = p.communicate(timeout=60)[1]
    assert p.returncode == 143, rest
    assert rest.strip().splitlines()[-1] == "driverd: terminated"
    assert list(cells.iterdir()) == []
    time.sleep(0.5)
    assert _processes_under(str(tmp_path)) == []
