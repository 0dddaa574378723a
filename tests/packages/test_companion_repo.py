"""Companion packages in a repository (driverd.repo.index: "companions" beside "packages" and "userspace") and their
lookup by (component, driver version, arch) for an installer (driverd.repo.companion): in an index, in a directory of
packages, and from the configured repositories through the download cache.

No real NVIDIA archive is reachable from the machines this suite runs on: the packages are built here from archives in
NVIDIA's documented layout (tests/packages/companionfake.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from driverd.build.companion import build_from_archive
from driverd.errors import ConfigError, PackageError
from driverd.repo import companion as source
from driverd.repo.index import INDEX_NAME, parse_index, write_index
from driverd.root import Root
from tests.conftest import run_cli
from tests.packages import companionfake as cf
from tests.packages import usfake

V = cf.V


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repository with a kernel-module package, a user-space package and three companions, indexed."""
    from driverd.sim.fakepkg import make_fake_package
    t = tmp_path_factory.mktemp("repo")
    r = t / "repo"
    r.mkdir()
    built = {}
    for comp, platform in (("fabricmanager", "x86_64"), ("nscq", "x86_64"), ("imex", "sbsa")):
        a = cf.archive(t / "src", comp, platform=platform)
        built[comp] = build_from_archive(a, r).ref
    usfake.plain_package(r, V)
    make_fake_package(r, V, "6.1.0-47-cloud-amd64", with_firmware=False)
    write_index(r)
    return r, built


def test_the_index_lists_companions_beside_kernel_and_user_space_packages(repo):
    r, built = repo
    raw = json.loads((r / INDEX_NAME).read_bytes())
    assert len(raw["packages"]) == 1 and len(raw["userspace"]) == 1
    assert sorted((e["component"], e["driver"], e["arch"]) for e in raw["companions"]) == \
        [("fabricmanager", V, "x86_64"), ("imex", V, "aarch64"), ("nscq", V, "x86_64")]
    idx = parse_index((r / INDEX_NAME).read_bytes(), "index")
    e = idx.find_companion("fabricmanager", V, "x86_64")
    assert e is not None and (e.sha256, e.path, e.size) == (built["fabricmanager"].sha256,
                                                           built["fabricmanager"].path.name, built["fabricmanager"].size)
    assert e.name == f"driverd-companion-fabricmanager-{V}-x86_64"
    assert source.in_index(idx, "imex", V, "arm64").sha256 == built["imex"].sha256      # Debian's arch name too
    assert source.in_index(idx, "imex", V, "x86_64") is None                           # built for aarch64 only
    assert source.in_index(idx, "nvlsm", V, "x86_64") is None
    assert source.in_index(idx, "fabricmanager", "535.261.03", "x86_64") is None
    with pytest.raises(PackageError, match="unknown companion component 'cuda'"):
        source.in_index(idx, "cuda", V, "x86_64")
    # the kernel-module and user-space lookups are what they were
    assert idx.find(V, "open", "6.1.0-47-cloud-amd64", "x86_64") is not None
    assert idx.find_userspace(V, "x86_64") is not None


def test_an_index_written_before_companions_still_reads_and_a_companion_listed_twice_is_refused(repo):
    r, _ = repo
    raw = json.loads((r / INDEX_NAME).read_bytes())
    old = {k: v for k, v in raw.items() if k != "companions"}
    idx = parse_index(json.dumps(old), "old index")
    assert idx.companions == () and idx.find_companion("fabricmanager", V, "x86_64") is None
    assert len(idx.packages) == 1 and "companions" not in idx.to_json()
    twice = dict(raw, companions=raw["companions"] + [dict(raw["companions"][0], sha256="f" * 64)])
    with pytest.raises(PackageError, match="is listed twice with different sha256"):
        parse_index(json.dumps(twice), "index")
    out = dict(raw, companions=[dict(raw["companions"][0], path="../../etc/passwd")])
    with pytest.raises(PackageError, match="leaves the repository"):
        parse_index(json.dumps(out), "index")


def test_repo_index_counts_them(repo, tmp_path):
    r, _ = repo
    copy = tmp_path / "r"
    shutil.copytree(r, copy)
    out = json.loads(run_cli("repo", "index", str(copy), "--json", check=True).stdout)
    assert (out["packages"], out["userspace_packages"], out["companion_packages"]) == (1, 1, 3)
    assert "3 companion packages" in run_cli("repo", "index", str(copy), check=True).stdout


def test_a_directory_of_packages_gives_the_one_asked_for(repo, tmp_path):
    r, built = repo
    assert source.in_directory(r, "nscq", V, "x86_64") == built["nscq"].path
    assert source.in_directory(r, "imex", V, "arm64") == built["imex"].path
    assert source.in_directory(r, "nscq", "535.261.03", "x86_64") is None
    assert source.in_directory(r, "nvlsm", V, "x86_64") is None
    # a file named as the one asked for whose manifest says otherwise is not it
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(built["fabricmanager"].path, d / f"driverd-companion-nscq-{V}-x86_64.{'0' * 64}.tar.zst")
    assert source.in_directory(d, "nscq", V, "x86_64") is None
    # root installs what it names: a directory others may write to is refused, in one line
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError) as e:
        source.in_directory(d, "nscq", V, "x86_64")
    assert "companion package directory" in e.value.one_line() and "writable" in e.value.one_line()


def _node(tmp_path, repos: list[str]):
    from driverd.config import load
    root = tmp_path / "node"
    (root / "etc/driverd").mkdir(parents=True)
    (root / "etc/driverd/config.toml").write_text(f"[packages]\nrepositories = {json.dumps(repos)}\n")
    return Root(str(root)), load(Root(str(root)), None, environ={})


def test_fetch_from_the_repositories_then_from_the_cache(repo, tmp_path):
    r, built = repo
    served = tmp_path / "served"
    shutil.copytree(r, served)
    root, cfg = _node(tmp_path, [f"file://{served}"])
    got = source.fetch(root, cfg, "fabricmanager", V, "x86_64")
    want = built["fabricmanager"]
    assert (got.sha256, got.source, os.path.basename(got.package)) == (want.sha256, f"file://{served}", want.path.name)
    assert got.package.startswith(str(root.real("/var/cache/driverd/packages")))
    # the repository gone: the cache's copy serves, checked again
    shutil.rmtree(served)
    again = source.fetch(root, cfg, "fabricmanager", V, "x86_64")
    assert (again.package, again.sha256, again.source) == (got.package, want.sha256, "cache")
    # not in the cache, and the repository cannot be read: said as such, never as a package it lacks
    with pytest.raises(PackageError) as e:
        source.fetch(root, cfg, "nscq", "535.261.03", "x86_64")
    line = e.value.one_line()
    assert f"cannot read the package repository: file://{served}" in line, line
    assert "whether one holds driverd-companion-nscq-535.261.03-x86_64 is unknown" in line, line


def test_fetch_takes_a_directory_first_and_says_what_a_repository_lacks(repo, tmp_path):
    r, built = repo
    root, cfg = _node(tmp_path, [f"file://{r}"])
    local = root.real("/srv/companions")
    local.mkdir(parents=True)
    shutil.copy(built["nscq"].path, local)
    got = source.fetch(root, cfg, "nscq", V, "x86_64", directory="/srv/companions")
    assert (got.source, got.sha256, os.path.dirname(got.package)) == ("/srv/companions", built["nscq"].sha256, str(local))
    with pytest.raises(PackageError) as e:
        source.fetch(root, cfg, "nvlsm", V, "x86_64", directory="/srv/companions")
    line = e.value.one_line()
    assert f"no companion package driverd-companion-nvlsm-{V}-x86_64 found in: file://{r} (its index lists 3 " \
        "companion packages, not this one)" in line, line
    assert "fix: driverd build-companion NVIDIA's nvlsm archive" in line
