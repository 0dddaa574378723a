"""`--root` confinement of driverd's own trees (issue 30): the package cache, the kept store, the
staging and installed trees under /lib and the repositories' trust state are written and deleted only
through the Root's confined writers. A directory of them replaced by a symlink that points outside the
root — absolute (a path that exists on this machine) or relative (climbing out with ../) — placed
before the command or swapped in while it runs, never makes driverd write or delete anything outside
the root: the link resolves inside the root, as the host itself would see it."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from driverd.errors import PackageError
from driverd.repo import fetch as fetch_mod
from driverd.install import modules as inst
from driverd.install import kept as kp
from driverd.repo.fetch import Want, fetch
from driverd.repo.index import write_index
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, write_host
from driverd.sim.scenario import make_index_key
from tests.packages.conftest import REL, snapshot

pytestmark = pytest.mark.real
WANT = Want("535.261.03", "open", REL, "x86_64")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo")
    make_fake_package(d, "535.261.03", REL)
    make_fake_package(d, "550.127.05", REL)
    write_index(d)
    return d


@pytest.fixture
def world(tmp_path):
    """A host tree and, beside it, a directory `outside` with a file in it that nothing may touch."""
    host = write_host(tmp_path / "host", HostSpec(release=REL))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.tar.zst").write_bytes(b"not driverd's")
    (outside / "keep").mkdir()
    (outside / "keep" / "file").write_text("mine\n")
    return host, outside


def link_out(at: Path, outside: Path, kind: str) -> None:
    """Replace `at` (a directory or nothing) with a symlink naming `outside`."""
    if at.is_symlink() or at.is_file():
        at.unlink()
    elif at.is_dir():
        shutil.rmtree(at)
    at.parent.mkdir(parents=True, exist_ok=True)
    target = str(outside) if kind == "absolute" else "../" * 16 + str(outside).lstrip("/")
    os.symlink(target, at)


KINDS = ["absolute", "relative"]


def inside(host: Path, outside: Path) -> Path:
    """Where a link to `outside` leads inside the root (both kinds resolve there)."""
    return host / str(outside).lstrip("/")


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_into_a_cache_linked_outside(world, repo, kind, resolver):
    host, outside = world
    before = snapshot(outside)
    link_out(host / "var/cache/driverd/packages", outside, kind)
    res = fetch(Root(host), WANT, [f"file://{repo}"], cache_max_mb=0)
    assert snapshot(outside) == before
    assert res.package.parent == inside(host, outside)
    assert res.package.is_file() and str(res.package).startswith(str(host) + "/")
    again = fetch(Root(host), WANT, [f"file://{repo}"], cache_max_mb=0)
    assert again.cached and again.package == res.package
    assert snapshot(outside) == before


@pytest.mark.parametrize("kind", KINDS)
def test_cache_pruning_never_deletes_outside(world, repo, kind, resolver):
    """packages.cache_max_mb = 0: everything but the package just fetched goes — inside the root."""
    host, outside = world
    before = snapshot(outside)
    link_out(host / "var/cache/driverd/packages", outside, kind)
    stale = inside(host, outside) / "old.tar.zst"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x" * 100)
    res = fetch(Root(host), WANT, [f"file://{repo}"], cache_max_mb=0)
    assert snapshot(outside) == before
    assert not stale.exists() and res.package.exists()


def test_cache_swapped_for_a_link_mid_way(world, repo, monkeypatch, resolver):
    """The cache directory becomes a link to `outside` between the download and the pruning."""
    host, outside = world
    before = snapshot(outside)
    real_verify = fetch_mod._verify_into_cache

    def verify_then_swap(*a, **kw):
        res = real_verify(*a, **kw)
        cache = host / "var/cache/driverd/packages"
        os.rename(cache, cache.with_name("packages.moved"))
        os.symlink(str(outside), cache)
        return res
    monkeypatch.setattr(fetch_mod, "_verify_into_cache", verify_then_swap)
    try:
        fetch(Root(host), WANT, [f"file://{repo}"], cache_max_mb=0)
    except PackageError:
        pass
    assert snapshot(outside) == before


def test_local_build_cache_linked_outside(world, repo, tmp_path, resolver):
    """The local-build fallback writes into the cache through the same confined directory."""
    host, outside = world
    before = snapshot(outside)
    link_out(host / "var/cache/driverd/packages", outside, "absolute")
    built = make_fake_package(tmp_path / "b", "580.82.07", REL)

    def builder(cache: Path) -> Path:
        assert str(cache).startswith(str(host) + "/")
        dst = cache / built.path.name
        shutil.copy(built.path, dst)
        return dst
    res = fetch(Root(host), Want("580.82.07", "open", REL, "x86_64"), [f"file://{repo}"], builder=builder,
                cache_max_mb=0)
    assert res.source == "local-build" and str(res.package).startswith(str(host) + "/")
    assert snapshot(outside) == before


@pytest.mark.parametrize("where", ["var/lib/driverd/packages/kept", "var/lib/driverd/packages",
                                   "lib/firmware/nvidia"])
@pytest.mark.parametrize("kind", KINDS)
def test_install_with_a_tree_linked_outside(world, pk, where, kind, resolver):
    host, outside = world
    before = snapshot(outside)
    link_out(host / where, outside, kind)
    rep = inst.install(host, pk["A"].path, Runner())
    assert rep.changed and inst.is_installed(host, REL, pk["A"].sha256)
    assert snapshot(outside) == before
    inst.install(host, pk["B"].path, Runner())          # replaces A: keeps it, retires the old tree
    assert inst.is_installed(host, REL, pk["B"].sha256)
    inst.rollback_install(host, REL, Runner())
    assert inst.is_installed(host, REL, pk["A"].sha256)
    kp.prune_kept(host, max_kept=0)
    assert snapshot(outside) == before


@pytest.mark.parametrize("kind", KINDS)
def test_install_with_updates_linked_outside(world, pk, kind, resolver):
    """lib/modules/<release>/updates links outside: driverd's files land inside the root (where the host
    sees them); depmod, run by path here, follows the link on this machine and finds no module, so the
    install is undone with one line — and nothing outside is written either way."""
    host, outside = world
    before = snapshot(outside)
    link_out(host / "lib/modules" / REL / "updates", outside, kind)
    with pytest.raises(PackageError, match="do not resolve"):
        inst.install(host, pk["A"].path, Runner())
    assert snapshot(outside) == before
    assert inst.recover(host, REL, Runner()) == []
    assert snapshot(outside) == before


def test_install_with_updates_swapped_mid_way(world, pk, monkeypatch, resolver):
    """lib/modules/<release>/updates becomes a link to `outside` after the package is kept, before the
    staging tree is made beside the installed one."""
    host, outside = world
    before = snapshot(outside)
    updates = host / "lib/modules" / REL / "updates"
    updates.mkdir(parents=True, exist_ok=True)
    real_stage = kp.stage_from

    def swap_then_stage(*a, **kw):
        if not updates.is_symlink():
            os.rename(updates, updates.with_name("updates.moved"))
            os.symlink(str(outside), updates)
        return real_stage(*a, **kw)
    monkeypatch.setattr(kp, "stage_from", swap_then_stage)
    try:
        inst.install(host, pk["A"].path, Runner())
    except PackageError:
        pass
    assert snapshot(outside) == before


def test_recover_removes_leftovers_inside_only(world, pk, resolver):
    """Leftover staging trees are deleted by recover(); a link named like one that points outside is
    removed as a link, never followed."""
    host, outside = world
    inst.install(host, pk["A"].path, Runner())
    before = snapshot(outside)
    updates = host / "lib/modules" / REL / "updates"
    os.symlink(str(outside), updates / ".driverd-staging-x")
    os.symlink(str(outside / "keep"), host / "var/lib/driverd/packages/kept/.driverd-old-y")
    notes = inst.recover(host, REL, Runner())
    assert len(notes) == 2, notes
    assert not os.path.lexists(updates / ".driverd-staging-x")
    assert snapshot(outside) == before


@pytest.mark.parametrize("kind", KINDS)
def test_trust_state_linked_outside(world, tmp_path, kind, resolver):
    host, outside = world
    d = tmp_path / "signed"
    make_fake_package(d, "535.261.03", REL)
    key, pub = make_index_key(tmp_path / "k")
    write_index(d, sign_key=str(key))
    before = snapshot(outside)
    link_out(host / "var/lib/driverd/repos", outside, kind)
    fetch(Root(host), WANT, [f"file://{d}"], public_key=str(pub), state_dir="/var/lib/driverd")
    assert snapshot(outside) == before
    assert [p.suffix for p in inside(host, outside).iterdir()] == [".json"]
