"""The kept store and the install/restore API: refusals change nothing (disk full, read-only, bad
input), no-ops write nothing, rollback alternates, pruning keeps what is in use, older layouts are
taken over, and every write stays inside the root."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from driverd.errors import PackageError
from driverd.install import modules as inst
from driverd.install import kept as kp
from driverd.root import Root
from driverd.runner import Runner
from tests.packages.conftest import (
    REL,
    STATE,
    copy_tree,
    pkgop,
    problems,
    result,
    show_depends,
    snapshot,
)

pytestmark = pytest.mark.real


def test_install_keeps_both_and_records_previous(tmp_path, pk, templates):
    A, B = pk["A"], pk["B"]
    root = copy_tree(templates["b"], tmp_path / "h")
    assert problems(root, B, kept=(A, B)) == []
    assert inst.previous_sha(root, REL) == (True, A.sha256)
    for ref in (A, B):
        k = kp.lookup(Root(root), "/var/lib/driverd", ref.sha256)
        assert k is not None and k.firmware is not None
        assert sorted(os.listdir(k.modules)) == sorted(["install.json", "manifest.json"] + [
            os.path.basename(f.path) for f in ref.manifest.module_files])
        assert kp.firmware_same(k.firmware, ref.manifest)
    # the installed tree shares its files with the kept entry (same filesystem: hard links)
    t = templates["b"]
    assert (t / "lib/modules" / REL / "updates/driverd/nvidia.ko").samefile(
        t / STATE / "kept" / B.sha256 / "modules/nvidia.ko")


def test_noop_install_restore_recover_write_nothing(tmp_path, pk, templates):
    A = pk["A"]
    root = copy_tree(templates["a"], tmp_path / "h")
    before = snapshot(root)
    for op in (("install", str(A.path)), ("restore", REL, A.sha256)):
        trace = tmp_path / f"{op[0]}.trace"
        out = result(pkgop(root, *op, faults={"FAULTS_TRACE": str(trace)}))
        assert out["ok"] and out["changed"] is False and out["notes"] == [], out
        assert not trace.exists(), trace.read_text()        # not one durable effect
    assert inst.recover(root, REL, Runner()) == []
    assert snapshot(root) == before


def test_restore_refusals_are_one_line_and_change_nothing(tmp_path, pk, templates):
    root = copy_tree(templates["a"], tmp_path / "h")
    before = snapshot(root)
    for sha, match in (("ab" * 32, "package abababababab is not kept for kernel"),
                       ("../../etc", "is not a package sha256")):
        with pytest.raises(PackageError, match=match) as ei:
            inst.restore(root, REL, sha, Runner())
        assert "\n" not in ei.value.one_line()
    with pytest.raises(PackageError, match="kernel release '../x' is not a plain name"):
        inst.restore(root, "../x", None, Runner())
    assert snapshot(root) == before


def test_restore_none_keeps_the_removed_package(tmp_path, pk, templates):
    A = pk["A"]
    root = copy_tree(templates["a_unkept"], tmp_path / "h")
    rep = inst.restore(root, REL, None, Runner())
    assert rep.changed and inst.is_installed(root, REL, None)
    assert not (root / "lib/modules" / REL / "updates/driverd").exists()
    assert inst.previous_sha(root, REL) == (True, A.sha256)
    assert show_depends_fails(root)
    inst.rollback_install(root, REL, Runner())
    assert problems(root, A, kept=(A,)) == []
    assert inst.previous_sha(root, REL) == (True, None)


def show_depends_fails(root) -> bool:
    try:
        show_depends(root)
    except AssertionError:
        return True
    return False


def test_rollback_twice_returns_to_the_start(tmp_path, pk, templates):
    A, B = pk["A"], pk["B"]
    root = copy_tree(templates["b"], tmp_path / "h")
    inst.rollback_install(root, REL, Runner())
    assert problems(root, A, kept=(A, B)) == [] and inst.previous_sha(root, REL) == (True, B.sha256)
    inst.rollback_install(root, REL, Runner())
    assert problems(root, B, kept=(A, B)) == [] and inst.previous_sha(root, REL) == (True, A.sha256)


def test_rollback_with_nothing_replaced(tmp_path):
    from driverd.sim.hosttree import HostSpec, write_host
    root = write_host(tmp_path / "h", HostSpec(release=REL))
    before = snapshot(root)
    assert inst.previous_sha(root, REL) == (False, None)
    with pytest.raises(PackageError, match="^nothing to roll back to") as ei:
        inst.rollback_install(root, REL, Runner())
    assert "\n" not in ei.value.one_line()
    assert snapshot(root) == before


# -- refusals while staging or keeping: nothing changed ------------------------------------------

def _other_than_disk_full(out: dict) -> bool:
    return not out["ok"] and "disk full" not in out["error"]


def test_disk_full_at_every_write_changes_nothing(tmp_path, pk, templates, forks):
    """ENOSPC on the Kth write/fsync call, for every K up to past the last one. Before the switch
    (keeping A, unpacking B, staging, the marker): "disk full ...; nothing was changed", the tree
    byte-identical (installed modules, modules.dep, kept store). After it (recording previous): the
    install says it was interrupted, and the next install finishes it. Where the failed call was one
    whose error does not matter (fsync of a directory), the install got through."""
    from concurrent.futures import ThreadPoolExecutor
    A, B = pk["A"], pk["B"]
    trace = tmp_path / "count.trace"
    result(pkgop(copy_tree(templates["a_unkept"], tmp_path / "count"), "install", str(B.path),
                 faults={"FAULTS_TRACE": str(trace)}))
    calls = sum(1 for ln in trace.read_text().splitlines() if ln.split()[1] == "fsync") + 10   # + os.write calls

    def one(k: int) -> tuple[str, list[str]]:
        root = copy_tree(templates["a_unkept"], tmp_path / f"k{k}")
        before = snapshot(root)
        out = result(forks(root, "install", str(B.path), faults={"FAULTS_RAISE": f"write:ENOSPC:{k}"}))
        outcome, bad = judge(root, k, before, out)
        if not bad:
            shutil.rmtree(root)
        return outcome, bad

    def judge(root, k, before, out) -> tuple[str, list[str]]:
        if out["ok"]:
            return "ok", [f"K={k}: {p}" for p in problems(root, B, kept=(A, B))]
        if out["type"] != "PackageError" or "\n" in out["error"]:
            return "bad", [f"K={k}: {out}"]
        if "disk full while installing into" in out["error"] and "nothing was changed" in out["error"]:
            return "disk full", [] if snapshot(root) == before else [f"K={k}: the tree changed"]
        if "was interrupted" not in out["error"]:
            return "bad", [f"K={k}: {out}"]
        out = result(forks(root, "install", str(B.path)))
        return "interrupted", [f"K={k}: {p}" for p in problems(root, B, kept=(A, B))] + (
            [] if out["ok"] else [f"K={k}: the next install failed: {out}"])
    with ThreadPoolExecutor(len(forks.procs)) as ex:
        res = list(ex.map(one, range(1, calls + 1)))
    failures = [p for _, ps in res for p in ps]
    outcomes = {o: sum(1 for r, _ in res if r == o) for o in ("disk full", "interrupted", "ok", "bad")}
    print(f"disk full at the Kth write/fsync, K=1..{calls}: {outcomes}")
    assert not failures, "\n".join(failures[:20])
    assert outcomes["disk full"] >= 20 and outcomes["interrupted"] >= 1 and not outcomes["bad"], outcomes
    assert res[-1][0] == "ok"


@pytest.mark.parametrize("spec", ["write:EDQUOT:2", "mkdir:EROFS:1", "replace:EROFS:1", "link:EROFS:1",
                                  "rename:EROFS:3", "mkdir:ENOSPC:3"])
def test_refused_write_changes_nothing(tmp_path, pk, templates, spec):
    B = pk["B"]
    root = copy_tree(templates["a_unkept"], tmp_path / "h")
    before = snapshot(root)
    out = result(pkgop(root, "install", str(B.path), faults={"FAULTS_RAISE": spec}))
    assert not out["ok"] and out["type"] == "PackageError" and "\n" not in out["error"], out
    assert "nothing was changed" in out["error"], out
    if "ENOSPC" in spec or "EDQUOT" in spec:
        assert "disk full while installing into" in out["error"]
    else:
        assert "Read-only file system" in out["error"]
    assert snapshot(root) == before


def test_read_only_after_the_switch_is_finished_by_the_next_call(tmp_path, pk, templates):
    """EROFS once the switch is under way (the exchange itself refused): PackageError, the marker
    stays, and the next call completes the switch."""
    A, B = pk["A"], pk["B"]
    root = copy_tree(templates["a"], tmp_path / "h")
    out = result(pkgop(root, "install", str(B.path), faults={"FAULTS_RAISE": "exchange:EROFS:1"}))
    assert not out["ok"] and "was interrupted" in out["error"] and "\n" not in out["error"], out
    assert not inst.is_installed(root, REL, A.sha256)             # a switch is pending
    out = result(pkgop(root, "install", str(B.path)))
    assert out["ok"] and any("finished the interrupted switch" in n for n in out["notes"]), out
    assert problems(root, B, kept=(A, B)) == []


def test_malformed_manifest_is_a_package_error(tmp_path, pk, templates):
    import io
    import tarfile

    import zstandard
    root = copy_tree(templates["a"], tmp_path / "h")
    before = snapshot(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        ti = tarfile.TarInfo("manifest.json")
        ti.size = 9
        t.addfile(ti, io.BytesIO(b'{"schema"'))
    bad = tmp_path / "bad.tar.zst"
    bad.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    with pytest.raises(PackageError, match="manifest.json is not JSON"):
        inst.install(root, bad, Runner())
    # an installed tree whose manifest is damaged is not kept (it could not be restored) ...
    (root / "lib/modules" / REL / "updates/driverd/manifest.json").write_text("{")
    assert kp.lookup(Root(root), "/var/lib/driverd", pk["A"].sha256) is not None
    assert not inst.is_installed(root, REL, pk["A"].sha256)
    # ... and installing over it works
    inst.install(root, pk["B"].path, Runner())
    assert problems(root, pk["B"], kept=(pk["A"], pk["B"])) == []
    assert snapshot(root) != before


# -- pruning ----------------------------------------------------------------------------------------

def test_prune_never_removes_current_previous_or_keep(tmp_path, pk, templates):
    from driverd.sim.fakepkg import make_fake_package
    A, B = pk["A"], pk["B"]
    C = make_fake_package(tmp_path / "c", "550.127.08", REL)
    D = make_fake_package(tmp_path / "d", "560.35.03", REL)
    root = copy_tree(templates["b"], tmp_path / "h")
    inst.install(root, C.path, Runner())
    assert set(kp.kept_shas(Root(root), "/var/lib/driverd")) == {A.sha256, B.sha256, C.sha256}
    inst.install(root, D.path, Runner())       # prunes to 3: A is the least recently used
    assert set(kp.kept_shas(Root(root), "/var/lib/driverd")) == {B.sha256, C.sha256, D.sha256}
    assert inst.prune_kept(root, keep={B.sha256}, max_kept=0) == []
    assert inst.prune_kept(root, max_kept=0) == [B.sha256]
    assert set(kp.kept_shas(Root(root), "/var/lib/driverd")) == {C.sha256, D.sha256}   # current, previous
    assert problems(root, D, kept=(C, D)) == []
    assert not [n for n in os.listdir(root / STATE / "kept") if n.startswith(".")]
    inst.rollback_install(root, REL, Runner())
    assert problems(root, C, kept=(C, D)) == []


# -- older layouts ----------------------------------------------------------------------------------

def test_older_previous_tree_is_taken_over(tmp_path, pk, templates):
    """previous/<release>/ (modules/, firmware/<v>/, state.json) of an older driverd becomes a kept
    entry and a previous record, so rollback still works."""
    A, B = pk["A"], pk["B"]
    root = copy_tree(templates["b"], tmp_path / "h")
    state = root / STATE
    legacy = state / "previous" / REL
    shutil.copytree(state / "kept" / A.sha256, legacy)
    (legacy / "state.json").write_text(json.dumps({"had_modules": True, "package_sha256": A.sha256}))
    shutil.rmtree(state / "kept" / A.sha256)
    os.unlink(state / "previous" / f"{REL}.json")
    assert inst.previous_sha(root, REL) == (False, None)
    notes = inst.recover(root, REL, Runner())
    assert any("into the kept store" in n for n in notes) and not legacy.exists()
    assert inst.previous_sha(root, REL) == (True, A.sha256)
    inst.rollback_install(root, REL, Runner())
    assert problems(root, A, kept=(A, B)) == []


def test_orphaned_holding_dir_is_rescued(tmp_path, pk, templates):
    """The reviewer's case: an older driverd killed after the switch left the last-known-good tree in
    packages/.driverd-old-*; recover keeps it before deleting the directory."""
    A, B = pk["A"], pk["B"]
    root = copy_tree(templates["b"], tmp_path / "h")
    state = root / STATE
    hold = state / ".driverd-old-x1"
    shutil.copytree(state / "kept" / A.sha256, hold)
    shutil.rmtree(state / "kept" / A.sha256)
    notes = inst.recover(root, REL, Runner())
    assert any(".driverd-old-x1" in n for n in notes) and not hold.exists()
    inst.restore(root, REL, A.sha256, Runner())
    assert problems(root, A, kept=(A, B)) == []


# -- writes stay inside the root ------------------------------------------------------------------

def test_absolute_symlinks_are_followed_inside_the_root(tmp_path, pk):
    """/var/lib/driverd and /lib/firmware/nvidia as absolute symlinks: what install writes lands under
    their targets inside the root, never on this machine."""
    from driverd.sim.hosttree import HostSpec, write_host
    A, B = pk["A"], pk["B"]
    root = write_host(tmp_path / "h", HostSpec(release=REL))
    outside = [p for p in ("/srv/driverd-test-state", "/usr/lib/firmware/nvidia/535.261.03") if os.path.exists(p)]
    (root / "srv/driverd-test-state").mkdir(parents=True)
    (root / "var/lib").mkdir(parents=True, exist_ok=True)
    os.symlink("/srv/driverd-test-state", root / "var/lib/driverd")
    (root / "usr/lib/firmware/nvidia").mkdir(parents=True)
    (root / "lib/firmware").mkdir(parents=True, exist_ok=True)
    os.symlink("/usr/lib/firmware/nvidia", root / "lib/firmware/nvidia")
    inst.install(root, A.path, Runner())
    inst.install(root, B.path, Runner())
    assert (root / "srv/driverd-test-state/packages/kept" / A.sha256 / "modules/nvidia.ko").is_file()
    assert (root / "srv/driverd-test-state/packages/previous" / f"{REL}.json").is_file()
    assert sorted(os.listdir(root / "usr/lib/firmware/nvidia")) == ["535.261.03", "550.127.05"]
    assert os.path.islink(root / "var/lib/driverd") and os.path.islink(root / "lib/firmware/nvidia")
    assert [p for p in ("/srv/driverd-test-state", "/usr/lib/firmware/nvidia/535.261.03")
            if os.path.exists(p)] == outside
    inst.rollback_install(root, REL, Runner())
    assert inst.is_installed(root, REL, A.sha256)
