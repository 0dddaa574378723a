"""build-matrix scheduling with a simulated compiler (the real compile is in test_package_real.py):
matrix parsing, skip/build/fail per cell, carrying on past failures, parallelism, progress output."""
from __future__ import annotations

import io
import threading
import time

import pytest

from driverd.errors import PackageError, UsageError
from driverd.build import matrix as mx
from driverd.build.modules import BuildResult, first_compiler_error
from driverd.sim.fakepkg import make_fake_package
from tests.conftest import REPO, require_binary

MATRIX = REPO / "kernels" / "debian-bookworm.toml"


def test_debian_matrix_parses():
    m = mx.load(MATRIX)
    assert {c.id for c in m.cells} == {f"535.261.03-{f}-6.1.0-{n}-cloud-amd64-x86_64"
                                       for f in ("open", "proprietary") for n in (47, 56)}
    c = m.cells[0]
    assert m.headers_hint(c) == f"apt-get install -y --no-install-recommends linux-headers-{c.release}"


def test_bad_matrix_files(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('[[drivers]]\nversion = "535.261.03"\nflavors = ["open"]\n[[kernels]]\nrelease = "6.1.0-47-cloud-amd64"\n')
    with pytest.raises(UsageError, match="no source for the open flavour"):
        mx.load(p)
    p.write_text("not toml [")
    with pytest.raises(UsageError, match="not valid TOML"):
        mx.load(p)
    with pytest.raises(UsageError, match="does not exist"):
        mx.load(tmp_path / "nope.toml")


def test_cells_built_skipped_failed_in_parallel(tmp_path):
    require_binary("modinfo", "/usr/sbin/modinfo")
    m = mx.load(MATRIX)
    out = tmp_path / "repo"
    make_fake_package(out, "535.261.03", "6.1.0-47-cloud-amd64", flavor="proprietary")   # already held
    running, peak, lock = [0], [0], threading.Lock()

    def fake_build(*, source, kernel, flavor, out, **kw):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        if kernel.startswith("6.1.0-56"):
            raise PackageError("build of x failed: nv-pci.c:1:1: error: too few arguments to function "
                               "'pci_resize_resource'", details={"log": "/tmp/x.log"})
        ref = make_fake_package(out, "535.261.03", kernel, flavor=flavor)
        return BuildResult(ref, False, 0.3)

    headers = tmp_path / "h"
    for rel in ("6.1.0-47-cloud-amd64", "6.1.0-56-cloud-amd64"):
        d = headers / "usr/src" / f"linux-headers-{rel}"
        d.mkdir(parents=True)
        (d / "Makefile").write_text("")
        (d / ".config").write_text("CONFIG_X86_64=y\n")
    from driverd.root import Root
    stream = io.StringIO()
    res = mx.run(m, out, jobs=3, work_dir=tmp_path / "w", root=Root(headers), build_fn=fake_build,
                 progress=mx.Progress(len(m.cells), stream=stream, tty=False))
    st = {r.cell.id: r.status for r in res}
    assert st == {"535.261.03-open-6.1.0-47-cloud-amd64-x86_64": "built",
                  "535.261.03-proprietary-6.1.0-47-cloud-amd64-x86_64": "skipped",
                  "535.261.03-open-6.1.0-56-cloud-amd64-x86_64": "failed",
                  "535.261.03-proprietary-6.1.0-56-cloud-amd64-x86_64": "failed"}
    assert peak[0] == 3           # three cells to build, three at once
    failed = next(r for r in res if r.status == "failed")
    assert "pci_resize_resource" in failed.reason and failed.log == "/tmp/x.log"
    lines = stream.getvalue().splitlines()
    assert any(ln.startswith("[") and "skipped 535.261.03-proprietary-6.1.0-47" in ln for ln in lines)
    assert lines[-1].startswith("[4/4]")
    # the index lists what the repository now holds
    import json
    idx = json.loads((out / "index.json").read_text())
    assert len(idx["packages"]) == 2
    # idempotent: a second run builds nothing it holds
    res2 = mx.run(m, out, jobs=2, work_dir=tmp_path / "w", root=Root(headers), build_fn=fake_build,
                  only=["*6.1.0-47*"], progress=mx.Progress(2, stream=io.StringIO(), tty=False))
    assert [r.status for r in res2] == ["skipped", "skipped"]


def test_missing_headers_cell_fails_with_how_to_get_them(tmp_path):
    from driverd.root import Root
    m = mx.load(MATRIX)
    res = mx.run(m, tmp_path / "repo", work_dir=tmp_path / "w", root=Root(tmp_path / "empty"),
                 only=["*-open-6.1.0-47*"], progress=mx.Progress(1, stream=io.StringIO(), tty=False))
    (r,) = res
    assert r.status == "failed"
    assert "kernel headers for 6.1.0-47-cloud-amd64 not found" in r.reason
    assert "apt-get install -y --no-install-recommends linux-headers-6.1.0-47-cloud-amd64" in r.reason


def test_progress_bar_on_a_terminal():
    s = io.StringIO()
    p = mx.Progress(2, stream=s, tty=True)
    c = mx.Cell("535.261.03", "open", "6.1.0-47-cloud-amd64", "x86_64", "/src", "debian")
    p.start(c)
    p.finish(mx.CellResult(c, "built", package="/r/p.tar.zst", seconds=3))
    p.close()
    assert "[############............] 1/2 built 1" in s.getvalue() and "\r\033[K" in s.getvalue()


def test_progress_shows_what_each_running_cell_does():
    """The bar carries the running cells' phases and compile counts (issue 32); without a terminal each
    phase is one line."""
    from driverd.build.progress import Status
    a = mx.Cell("535.261.03", "open", "6.1.0-47-cloud-amd64", "x86_64", "/src", "debian")
    b = mx.Cell("535.261.03", "open", "6.1.0-50-cloud-amd64", "x86_64", "/src", "debian")
    s = io.StringIO()
    p = mx.Progress(2, stream=s, tty=True)
    p.start(a)
    p.start(b)
    p.cell(a).status(Status(a.id, "compile", 75.0, 57, 193))
    p.cell(b).status(Status(b.id, "conftest", 20.0, 12, None))
    last = s.getvalue().rsplit("\r\033[K", 1)[1]
    assert last.startswith("[........................] 0/2 built 0 skipped 0 failed 0 ")
    assert "| open-6.1.0-47-cloud-amd64-x86_64: compiling 57/193 objects" in last
    assert "; open-6.1.0-50-cloud-amd64-x86_64: running conftest (12 tests)" in last
    p.finish(mx.CellResult(a, "built", package="/r/p.tar.zst", seconds=80))
    last = s.getvalue().rsplit("\r\033[K", 1)[1]
    assert "1/2 built 1" in last and "compiling" not in last.split("\n")[-1]
    s = io.StringIO()
    p = mx.Progress(1, stream=s, tty=False)
    p.cell(a).status(Status(a.id, "compile", 75.0, 1, 193))
    p.cell(a).status(Status(a.id, "compile", 76.0, 2, 193))          # the same phase: no new line
    p.cell(a).status(Status(a.id, "link", 130.0, 0, 5))
    assert s.getvalue() == (f"[0/1] compile {a.id}: compiling 1/193 objects (1m15s)\n"
                            f"[0/1] link    {a.id}: linking 0/5 modules (2m10s)\n")


def test_first_compiler_error_is_one_line():
    log = ("  CC [M]  /w/nvidia/nv.o\n/w/nvidia/nv-pci.c: In function 'nv_resize_pcie_bars':\n"
           "/w/nvidia/nv-pci.c:220:9: warning: unused variable 'x'\n"
           "/w/nvidia/nv-pci.c:240:9: error: too few arguments to function 'pci_resize_resource'\n"
           "make[2]: *** [scripts/Makefile.build:250: /w/nvidia/nv-pci.o] Error 1\n")
    from pathlib import Path
    assert first_compiler_error(log, Path("/w")) == \
        "nvidia/nv-pci.c:240:9: error: too few arguments to function 'pci_resize_resource'"
    assert first_compiler_error("make: *** No rule to make target 'modules'.  Stop.\n").startswith("make: ***")
