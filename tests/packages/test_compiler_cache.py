"""The compiler cache of `driverd build` (ccache): real kbuild builds of the stand-in modules
(tests/vm/standin) against Debian's 6.1.0-47 and 6.1.0-56 cloud headers, through the real ccache.

What must hold: a build served from a warm cache makes the modules an uncached build of the same
inputs makes — another kernel release or another driver source never gets a module with the wrong
vermagic, version or srcversion — and a rebuild of the same inputs in another directory is served
entirely from the cache. A cache that does serve a stale object (injected here, from the test side:
a wrapper in front of ccache) is caught by the check every build runs, and nothing is packed."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from driverd import observe
from driverd.errors import PackageError
from driverd.build import compiler_cache as cc
from driverd.build.modules import WrongModule, build
from driverd.package.archive import read_manifest, unpack
from driverd.build.compiler_cache import CompilerCache
from driverd.package.modfields import module_fields
from tests.conftest import missing_component, require_binary, run_cli
from tests.vm.harness import standin_source

A, B = "6.1.0-47-cloud-amd64", "6.1.0-56-cloud-amd64"      # one series, two ABIs (6.1.170, 6.1.192)


# -- without a compiler ---------------------------------------------------------------------------

def test_off_is_no_cache_and_auto_without_ccache_is_no_cache(tmp_path, monkeypatch):
    assert cc.resolve("off", tmp_path / "c", 100) is None
    monkeypatch.setattr(cc, "which", lambda name: None)
    assert cc.resolve("auto", tmp_path / "c", 100) is None
    assert not (tmp_path / "c").exists()


def test_on_without_ccache_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "which", lambda name: None)
    with pytest.raises(PackageError) as e:
        cc.resolve("on", tmp_path / "c", 100)
    line = e.value.one_line()
    assert "\n" not in line and e.value.exit_code == 3
    assert line.startswith("build.ccache is on but ccache is not installed")
    assert "apt-get install ccache" in line and 'set build.ccache = "auto" or "off"' in line
    with pytest.raises(PackageError) as e:
        cc.resolve("on", tmp_path / "c", 100, where="--ccache")
    assert "pass --ccache off" in e.value.one_line()


def test_an_unusable_cache_directory_is_one_line(tmp_path):
    require_binary("ccache")
    (tmp_path / "file").write_text("")
    with pytest.raises(PackageError) as e:
        cc.resolve("on", tmp_path / "file" / "c", 100)
    assert "is not usable" in e.value.message and "--ccache-dir" in e.value.one_line()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
@pytest.mark.parametrize("case", ["world-writable", "other-owner", "parent-writable"])
def test_a_cache_or_repository_directory_others_can_write_is_refused(tmp_path, case):
    """Issue 44, items 3 and 7: whoever else can write the compiler cache can store objects under a build's
    keys, and whoever can write the repository can replace a package before it is indexed and signed: both
    directories must be root's (or the building user's), not group/world-writable, on such a path."""
    from driverd.build.modules import check_out
    require_binary("ccache")
    d = tmp_path / "shared" / "dir"
    d.mkdir(parents=True)
    if case == "world-writable":
        os.chmod(d, 0o777)
    elif case == "other-owner":
        os.chown(d, 65534, 65534)
    else:
        os.chmod(tmp_path / "shared", 0o777)
    for check in (lambda: cc.resolve("on", d, 100), lambda: check_out(d)):
        with pytest.raises(Exception) as e:
            check()
        line = e.value.one_line()
        assert e.value.exit_code == 2 and "\n" not in line, line
        assert "refusing " in line and ("chmod go-w" in line or "chown root" in line), line
    r = run_cli("repo", "index", str(d))
    assert r.returncode == 2 and "refusing repository directory" in r.stderr, r.stderr


def test_kernel_view_of_debians_split_headers(tmp_path):
    """Debian's layout: an arch tree whose Makefile includes the common tree's, and a `scripts` link
    leading out of the tree. The view resolves the same files through paths inside the cell."""
    usr = tmp_path / "usr"
    common, arch, kbuild = usr / "src/hdr-common", usr / "src/hdr-arch", usr / "lib/kbuild/scripts"
    for d in (common / "include/linux", arch / "include/generated", kbuild):
        d.mkdir(parents=True)
    (common / "Makefile").write_text("# the kernel's top Makefile\n")
    (common / "include/linux/module.h").write_text("/* module.h */\n")
    (arch / "Makefile").write_text(f"include {common}/Makefile\n")
    (arch / ".config").write_text("CONFIG_X86_64=y\n")
    (arch / "scripts").symlink_to("../../lib/kbuild/scripts")
    (kbuild / "fixdep").write_text("")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()}
    cell = tmp_path / "cell"
    cell.mkdir()
    out, src = cc.kernel_view(arch, common, cell)
    assert (out, src) == (cell / "kernel/build", cell / "kernel/source")
    assert (out / "Makefile").read_text() == f"include {src}/Makefile\n"
    assert not (out / "Makefile").is_symlink()
    assert (src / "include/linux/module.h").read_text() == "/* module.h */\n"
    assert (out / ".config").read_text() == "CONFIG_X86_64=y\n"
    assert (out / "scripts/fixdep").resolve() == (kbuild / "fixdep").resolve()
    # nothing of the installed trees changed
    assert {p: p.read_bytes() for p in before} == before
    assert (arch / "Makefile").read_text() == f"include {common}/Makefile\n"


def test_kernel_view_of_an_output_tree_with_a_source_link_and_of_one_tree(tmp_path):
    src, obj = tmp_path / "linux", tmp_path / "obj"
    (src / "include").mkdir(parents=True)
    obj.mkdir()
    (src / "Makefile").write_text("# top\n")
    (obj / "Makefile").write_text(f"# generated by kbuild\ninclude {src}/Makefile\n")
    (obj / "source").symlink_to(src)
    cell = tmp_path / "cell"
    cell.mkdir()
    out, vsrc = cc.kernel_view(obj, src, cell)
    assert (out / "source").resolve() == vsrc.resolve() == (cell / "kernel/source").resolve()
    assert f"include {vsrc}/Makefile" in (out / "Makefile").read_text()
    assert (obj / "source").resolve() == src.resolve()
    one = tmp_path / "cell1"
    one.mkdir()
    out, vsrc = cc.kernel_view(src, src, one)
    assert out == vsrc == one / "kernel/build" and (out / "Makefile").read_text() == "# top\n"


def test_tree_identity_names_the_set_of_files_not_their_content(tmp_path):
    k, m = tmp_path / "kernel", tmp_path / "module"
    for d in (k / "include/linux", m / "common/inc"):
        d.mkdir(parents=True)
    (k / "include/linux/module.h").write_text("a")
    (m / "nv.c").write_text("b")
    first = cc.tree_identity(k, m)
    (k / "include/linux/module.h").write_text("changed")        # ccache checks content itself
    assert cc.tree_identity(k, m) == first
    (m / "common/inc/module.h").write_text("")                  # a new file anywhere: another identity
    assert cc.tree_identity(k, m) != first
    (m / "common/inc/module.h").unlink()
    assert cc.tree_identity(k, m) == first
    assert cc.tree_identity(m, k) != first                      # which tree a file is in counts


def test_the_kernels_compiler_is_kept(tmp_path):
    front = tmp_path / "front"
    (tmp_path / ".kernelvariables").write_text("CCACHE = ccache\nCC = $(if $(DEBIAN_KERNEL_USE_CCACHE),"
                                               "$(CCACHE)) $(CROSS_COMPILE)gcc-12\n")
    assert cc.make_variables(front, tmp_path) == ["DEBIAN_KERNEL_USE_CCACHE=1", f"CCACHE={front}"]
    (tmp_path / ".kernelvariables").unlink()
    assert cc.make_variables(front, tmp_path) == [f"CC={front} gcc"]


def test_conftest_programs_bypass_the_cache_and_the_rest_go_through_it(tmp_path):
    """The front command with a stand-in for ccache that records its calls."""
    log = tmp_path / "calls"
    fake = tmp_path / "fake ccache"                    # a path that needs quoting
    fake.write_text(f'#!/bin/sh\necho "ccache $*" >> "{log}"\n')
    fake.chmod(0o755)
    cell = tmp_path / "cell"
    cell.mkdir()
    front = cc.front(CompilerCache(str(fake), tmp_path / "c", 10), cell)
    import subprocess
    subprocess.run([front, "echo", "-c", "-o", "x.o", "x.c"], check=True)
    direct = subprocess.run([front, "echo", "-c", "conftest12345.c"], check=True, capture_output=True, text=True)
    subprocess.run([front, "echo", "-c", "/abs/dir/conftest7.c", "-o", "conftest7.o"], check=True)
    subprocess.run([front, "echo", "-c", "myconftest.c"], check=True)
    assert log.read_text().splitlines() == ["ccache echo -c -o x.o x.c", "ccache echo -c myconftest.c"]
    assert direct.stdout == "-c conftest12345.c\n"


# -- real builds ----------------------------------------------------------------------------------

def _need():
    for b in ("make", "gcc", "ccache"):
        require_binary(b)
    for r in (A, B):
        if not os.path.isfile(f"/usr/src/linux-headers-{r}/Makefile"):
            missing_component(f"linux-headers-{r} is missing (bash .ci/install-components installs it)")


def _source(base: Path, version: str, edit: str = "") -> Path:
    src = standin_source(base, version)
    if edit:
        with open(src / "nvidia.c", "a") as f:
            f.write(edit)
    return src


def _build(src: Path, release: str, out: Path, work: Path, cache: CompilerCache | None):
    return build(source=src, kernel=release, flavor="open", out=out, work_dir=work,
                 headers=f"/usr/src/linux-headers-{release}", ccache=cache)


def _fields(pkg: Path, tmp: Path) -> dict[str, dict]:
    """Every module's modinfo fields, read from the packed .ko files."""
    # a directory of its own per call: two builds of the same inputs may pack the same package name
    d = Path(tempfile.mkdtemp(prefix="x-", dir=tmp)) / "pkg"
    unpack(pkg, d)
    return {p.name: {k: v for k, v in module_fields(p).items() if k != "filename"}
            for p in sorted((d / "modules").glob("*.ko"))}


@pytest.fixture
def cache(tmp_path):
    _need()
    return cc.resolve("on", tmp_path / "ccache", 512)


@pytest.mark.real
def test_a_rebuild_in_another_directory_is_served_from_the_cache(tmp_path, cache):
    src = _source(tmp_path / "src", "535.261.03")
    first = _build(src, A, tmp_path / "out1", tmp_path / "w1", cache)
    again = _build(src, A, tmp_path / "out2", tmp_path / "w2", cache)
    assert first.ccache["misses"] > 0 and first.ccache["hits"] == 0
    # every compile the first build stored is served: the cell directory, its random name and the
    # per-release header paths play no part in the cache key
    assert again.ccache.get("misses") == 0 and again.ccache.get("hits") == first.ccache["misses"] + first.ccache["hits"]
    assert _fields(again.package.path, tmp_path) == _fields(first.package.path, tmp_path)


@pytest.mark.real
def test_a_warm_cache_from_another_kernel_release_gives_that_releases_modules(tmp_path, cache):
    src = _source(tmp_path / "src", "535.261.03")
    _build(src, A, tmp_path / "outA", tmp_path / "w1", cache)
    warm = _build(src, B, tmp_path / "outB", tmp_path / "w2", cache)
    cold = _build(src, B, tmp_path / "outB-cold", tmp_path / "w3", None)
    want = _fields(cold.package.path, tmp_path)
    got = _fields(warm.package.path, tmp_path)
    assert got == want
    assert {f["vermagic"][0].split()[0] for f in got.values()} == {B}
    assert read_manifest(warm.package.path).vermagic.split()[0] == B
    # each module's .mod.c names the release (vermagic): compiled again, never taken from release A
    assert warm.ccache["misses"] >= len(got)
    print(f"\nstand-in {A} -> {B}: {warm.ccache}")


@pytest.mark.real
def test_a_warm_cache_from_another_driver_source_gives_that_sources_modules(tmp_path, cache):
    old = _build(_source(tmp_path / "src1", "535.261.03"), A, tmp_path / "out1", tmp_path / "w1", cache)
    src2 = _source(tmp_path / "src2", "535.261.04", edit="\nint nv_standin_point_release(void) { return 4; }\n")
    warm = _build(src2, A, tmp_path / "out2", tmp_path / "w2", cache)
    cold = _build(src2, A, tmp_path / "out3", tmp_path / "w3", None)
    got, want, before = (_fields(r.package.path, tmp_path) for r in (warm, cold, old))
    assert got == want
    assert {f["version"][0] for f in got.values()} == {"535.261.04"}
    assert got["nvidia.ko"]["srcversion"] != before["nvidia.ko"]["srcversion"]


@pytest.mark.real
def test_a_header_that_appears_earlier_on_the_include_path_is_compiled_in(tmp_path, cache):
    """The trap of ccache's direct mode ("header files that were not used, but would have been used if
    they existed, are not" checked), which the same paths in every cell would widen to other kernel
    releases and driver sources: the next source adds a header that shadows one the previous build
    used, every other input the same. Its module must carry the new header's value."""
    def source(d: Path, shadow: bool) -> Path:
        src = _source(d, "535.261.03", edit='\n#include "probe.h"\nMODULE_INFO(standin_probe, PROBE);\n')
        with open(src / "Kbuild", "a") as f:
            f.write("ccflags-y += -I$(src)/first -I$(src)/second\n")
        (src / "second").mkdir()
        (src / "second/probe.h").write_text('#define PROBE "second"\n')
        if shadow:
            (src / "first").mkdir()
            (src / "first/probe.h").write_text('#define PROBE "first"\n')
        return src
    one = _build(source(tmp_path / "src1", False), A, tmp_path / "out1", tmp_path / "w1", cache)
    two = _build(source(tmp_path / "src2", True), A, tmp_path / "out2", tmp_path / "w2", cache)
    assert _fields(one.package.path, tmp_path)["nvidia.ko"]["standin_probe"] == ["second"]
    assert _fields(two.package.path, tmp_path)["nvidia.ko"]["standin_probe"] == ["first"]


@pytest.mark.real
def test_inherited_ccache_settings_and_a_config_file_in_the_cache_change_nothing(tmp_path, cache, monkeypatch):
    """A shared cache directory may hold a ccache.conf, and the builder's environment CCACHE_*
    variables: neither may switch the cache off, force recompiles or loosen what is hashed."""
    src = _source(tmp_path / "src", "535.261.03")
    first = _build(src, A, tmp_path / "out1", tmp_path / "w1", cache)
    (cache.directory / "ccache.conf").write_text("disable = true\nrecache = true\nhash_dir = true\n")
    for k in ("CCACHE_DISABLE", "CCACHE_RECACHE", "CCACHE_HASHDIR"):
        monkeypatch.setenv(k, "1")
    monkeypatch.setenv("CCACHE_BASEDIR", "/")
    again = _build(src, A, tmp_path / "out2", tmp_path / "w2", cache)
    assert again.ccache.get("misses") == 0 and again.ccache.get("hits") == first.ccache["misses"]


# The stale cache, from the test side: a wrapper that kbuild calls in ccache's place. It runs the real
# ccache, then either keeps a copy of each module's .mod.o (record) or replaces the fresh one with the
# copy kept from another build (replay) — what a cache keyed on the wrong inputs would serve.
STALE = """#!/bin/sh
"$STALE_REAL_CCACHE" "$@" || exit $?
prev=""; out=""
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
case "$out" in
  *.mod.o) name=$(basename "$out")
           if [ "$STALE_MODE" = record ]; then cp "$out" "$STALE_DIR/$name"; else cp "$STALE_DIR/$name" "$out"; fi;;
esac
"""


def _stale_cache(tmp_path: Path, real: CompilerCache, monkeypatch) -> CompilerCache:
    w = tmp_path / "stale-ccache"
    w.write_text(STALE)
    w.chmod(w.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "stash").mkdir()
    monkeypatch.setenv("STALE_REAL_CCACHE", real.binary)
    monkeypatch.setenv("STALE_DIR", str(tmp_path / "stash"))
    return CompilerCache(str(w), real.directory, real.max_mb)


@pytest.mark.real
def test_a_stale_object_of_another_driver_source_is_refused(tmp_path, cache, monkeypatch):
    stale = _stale_cache(tmp_path, cache, monkeypatch)
    monkeypatch.setenv("STALE_MODE", "record")
    _build(_source(tmp_path / "src1", "535.261.03"), A, tmp_path / "out1", tmp_path / "w1", stale)
    monkeypatch.setenv("STALE_MODE", "replay")
    src2 = _source(tmp_path / "src2", "535.261.03", edit="\nint nv_standin_patched(void) { return 1; }\n")
    out = tmp_path / "out2"
    seen: list[tuple[str, dict]] = []
    stop = observe.subscribe(lambda ev, f: seen.append((ev, f)))
    try:
        with pytest.raises(WrongModule) as e:
            _build(src2, A, out, tmp_path / "w2", stale)
    finally:
        stop()
    assert "srcversion" in e.value.message and "this tree's sources give" in e.value.message
    assert [f["reason"] for ev, f in seen if ev == "package.build"] == ["check"]     # the metrics' reason
    assert f"ccache -C -d {cache.directory}" in e.value.one_line() and "\n" not in e.value.one_line()
    assert not out.exists() or not list(out.glob("*.tar.zst"))


@pytest.mark.real
def test_a_stale_object_of_another_kernel_release_is_refused(tmp_path, cache, monkeypatch):
    stale = _stale_cache(tmp_path, cache, monkeypatch)
    src = _source(tmp_path / "src", "535.261.03")
    monkeypatch.setenv("STALE_MODE", "record")
    _build(src, A, tmp_path / "out1", tmp_path / "w1", stale)
    monkeypatch.setenv("STALE_MODE", "replay")
    out = tmp_path / "out2"
    with pytest.raises(WrongModule) as e:
        _build(src, B, out, tmp_path / "w2", stale)
    assert e.value.message.endswith(f"was built for kernel {A}, not {B}")
    assert not out.exists() or not list(out.glob("*.tar.zst"))


@pytest.mark.real
def test_build_command_reports_the_caches_work(tmp_path):
    _need()
    src = _source(tmp_path / "src", "535.261.03")
    args = ["build", "--source", str(src), "--kernel", A, "--flavor", "open", "--headers",
            f"/usr/src/linux-headers-{A}", "--work-dir", str(tmp_path / "w"), "--ccache", "on", "--json"]
    r1 = run_cli(*args, "--out", str(tmp_path / "o1"))
    r2 = run_cli(*args, "--out", str(tmp_path / "o2"))
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr + r2.stderr
    one, two = json.loads(r1.stdout)["ccache"], json.loads(r2.stdout)["ccache"]
    assert one["dir"] == two["dir"] == str(tmp_path / "w" / "ccache")        # the default: in the work dir
    assert two["misses"] == 0 and two["hits"] == one["misses"] > 0
    r3 = run_cli(*args[:-3], "--ccache", "off", "--json", "--out", str(tmp_path / "o3"))
    assert r3.returncode == 0, r3.stderr
    assert json.loads(r3.stdout)["ccache"] is None
    shutil.rmtree(tmp_path / "w", ignore_errors=True)


# -- a compromised build pod (issue 44, item 3) ------------------------------------------------------------
# What one build pod can do to a cache it can write: compile another cell's inputs through the real ccache
# with a CCACHE_PREFIX (not part of ccache's key) that adds its payload to every object, and CCACHE_RECACHE
# (store over what is there). The victim's clean build then got every object from the cache — vermagic,
# version and srcversion from the sources, so the module check passed — with the payload inside.
PAYLOAD = b"DRIVERD-TEST-ATTACKER-PAYLOAD"
POISON_PREFIX = """#!/bin/sh
"$@" || exit $?
prev=""; out=""
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
case "$out" in *.o) objcopy --add-section .driverd_attacker="$DRIVERD_TEST_PAYLOAD" "$out" || exit 1;; esac
"""
POISONER = """#!/bin/sh
CCACHE_PREFIX="$DRIVERD_TEST_PREFIX" CCACHE_RECACHE=1 exec "$DRIVERD_TEST_REAL_CCACHE" "$@"
"""


def _has_payload(pkg: Path, tmp: Path) -> list[str]:
    d = Path(tempfile.mkdtemp(prefix="p-", dir=tmp)) / "pkg"
    unpack(pkg, d)
    return [p.name for p in sorted((d / "modules").glob("*.ko")) if PAYLOAD in p.read_bytes()]


@pytest.mark.real
def test_a_poisoned_cache_entry_from_another_cells_pod_never_reaches_the_victims_module(tmp_path, monkeypatch):
    """The rendered build-matrix Job run as the kubelet would run it (each volume mounted at its subPathExpr):
    the pod of cell B is compromised and poisons, with real kbuild and the real ccache, the objects of cell
    A's exact inputs in every cache directory it can write. The pod of cell A then builds A: no object of
    the attacker's is in its modules, because no pod reads a cache another pod can write."""
    from driverd.build import matrix as mx
    from driverd.build import job as mj
    from tests.packages.test_matrix_job import _as_kubelet, _pod_args
    _need()
    require_binary("objcopy")
    version = "535.261.03"
    src = _source(tmp_path / "src", version)
    mfile = tmp_path / "matrix.toml"
    mfile.write_text(f'[[drivers]]\nversion = "{version}"\nflavors = ["open"]\nsources.open = "{src}"\n'
                     f'[[kernels]]\nrelease = "{A}"\n[[kernels]]\nrelease = "{B}"\n')
    m = mx.load(mfile)
    cm, job, _ = mj.render(m, m.cells, mj.JobOptions())
    (c,) = job["spec"]["template"]["spec"]["containers"]
    ids = cm["data"]["cells"].splitlines()
    victim, attacker = ids.index(f"{version}-open-{A}-x86_64"), ids.index(f"{version}-open-{B}-x86_64")
    etc = tmp_path / "etc-matrix"
    etc.mkdir()
    for k, v in cm["data"].items():
        (etc / k).write_text(v)
    vols = {"repo": tmp_path / "repo-volume", "matrix": etc, "work": tmp_path / "work",
            "ccache": tmp_path / "ccache-volume"}
    real = cc.resolve("on", tmp_path / "unused", 512)

    # the compromised pod: what its /ccache leads to is all it can write
    own = _as_kubelet(c, attacker, vols)["/ccache"]
    for name, text in (("prefix", POISON_PREFIX), ("poisoner", POISONER)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "payload").write_bytes(PAYLOAD)
    monkeypatch.setenv("DRIVERD_TEST_PREFIX", str(tmp_path / "prefix"))
    monkeypatch.setenv("DRIVERD_TEST_REAL_CCACHE", real.binary)
    monkeypatch.setenv("DRIVERD_TEST_PAYLOAD", str(tmp_path / "payload"))
    poisoned = _build(src, A, tmp_path / "attacker-out", tmp_path / "attacker-work",
                      CompilerCache(str(tmp_path / "poisoner"), own, 512))
    assert _has_payload(poisoned.package.path, tmp_path)          # the poisoning works: its own build has it
    # ... under A's keys in its cache, and in the layout a cell's cache has (<dir>/cells/<cell id>)
    shutil.copytree(own, own / "cells" / ids[victim], ignore=shutil.ignore_patterns("cells"))
    for k in ("DRIVERD_TEST_PREFIX", "DRIVERD_TEST_REAL_CCACHE", "DRIVERD_TEST_PAYLOAD"):
        monkeypatch.delenv(k)

    # the victim's pod, its own command line through the real CLI
    mounts = _as_kubelet(c, victim, vols)
    r = run_cli(*_pod_args(c["args"], mounts, victim), "--json",
                env={e["name"]: e["value"] for e in c["env"] if "value" in e})
    assert r.returncode == 0, r.stderr[-3000:]
    (cell,) = json.loads(r.stdout)["cells"]
    assert cell["status"] == "built" and cell["id"] == ids[victim]
    assert _has_payload(Path(cell["package"]), tmp_path) == []
    assert cell["ccache"]["hits"] == 0 and cell["ccache"]["misses"] > 0, cell["ccache"]
