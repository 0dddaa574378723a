"""Repository index and fetch: file:// and a loopback HTTP server with truncation, resume, retries,
wrong hashes, duplicate index entries, signatures, cache bound and the local-build fallback."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from driverd.errors import PackageError
from driverd.repo import fetch as fetch_mod
from driverd.repo.fetch import Want, fetch, prune_cache
from driverd.repo.index import INDEX_NAME, parse_index, write_index
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, write_host
from driverd.sim.httprepo import RepoServer
from driverd.sim.scenario import make_index_key
from tests.conftest import require_binary, run_cli

REL = "6.1.0-47-cloud-amd64"
WANT = Want("535.261.03", "open", REL, "x86_64")
pytestmark = pytest.mark.real


@pytest.fixture(autouse=True)
def _kmod():
    require_binary("modinfo", "/usr/sbin/modinfo")


@pytest.fixture(scope="module")
def index_key(tmp_path_factory):
    return make_index_key(tmp_path_factory.mktemp("indexkey"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory, index_key):
    """A repository whose index is signed (the default a node requires over http)."""
    d = tmp_path_factory.mktemp("repo")
    make_fake_package(d, "535.261.03", REL, text_size=400_000)     # ~2 MB: several chunks on the wire
    make_fake_package(d, "550.127.05", REL)
    make_fake_package(d / "sub", "535.261.03", "6.1.0-56-cloud-amd64")
    write_index(d, sign_key=str(index_key[0]))
    return d


@pytest.fixture(scope="module")
def pub(index_key):
    return str(index_key[1])


@pytest.fixture
def host(tmp_path):
    return Root(write_host(tmp_path / "host", HostSpec(release=REL)))


def test_index_lists_every_package(repo):
    idx = json.loads((repo / INDEX_NAME).read_text())
    rows = {(p["driver"], p["flavor"], p["kernel_release"], p["arch"]) for p in idx["packages"]}
    assert rows == {("535.261.03", "open", REL, "x86_64"), ("550.127.05", "open", REL, "x86_64"),
                    ("535.261.03", "open", "6.1.0-56-cloud-amd64", "x86_64")}
    for p in idx["packages"]:
        f = repo / p["path"]
        assert f.stat().st_size == p["size"] and p["sha256"] in f.name
    assert any(p["path"].startswith("sub/") for p in idx["packages"])


def test_index_rewrite_is_atomic_and_refuses_duplicates(tmp_path, repo):
    d = tmp_path / "r"
    shutil.copytree(repo, d)
    before = (d / INDEX_NAME).read_bytes()
    # a second, different package for the same cell: the index would list the cell twice
    other = make_fake_package(tmp_path / "x", "535.261.03", REL, text_size=10)
    shutil.copy(other.path, d / "dup" / other.path.name) if (d / "dup").mkdir() is None else None
    with pytest.raises(PackageError, match="listed twice with different sha256"):
        write_index(d)
    assert (d / INDEX_NAME).read_bytes() == before
    assert not [n for n in os.listdir(d) if n.startswith(".")]


def test_index_with_duplicate_cell_is_refused_by_fetch(tmp_path, host, repo):
    d = tmp_path / "r"
    shutil.copytree(repo, d)
    idx = json.loads((d / INDEX_NAME).read_text())
    e = dict(next(p for p in idx["packages"] if p["driver"] == "535.261.03" and p["kernel_release"] == REL))
    e["sha256"] = "f" * 64
    idx["packages"].append(e)
    (d / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(PackageError, match="listed twice with different sha256"):
        fetch(host, WANT, [f"file://{d}"])
    r = run_cli("fetch", "--root", host.base, "--driver", "535.261.03", "--flavor", "open", "--repo", f"file://{d}",
                "--no-build")
    assert r.returncode == 3 and r.stderr.count("\n") == 1


def test_fetch_file_repo_and_cache(host, repo):
    res = fetch(host, WANT, [f"file://{repo}"])
    assert res.source == f"file://{repo}" and not res.cached
    assert res.package.parent == Path(host.base) / "var/cache/driverd/packages"
    again = fetch(host, WANT, [str(repo)])
    assert again.cached and again.package == res.package


def test_fetch_http_with_truncation_resume_and_retry(host, repo, pub):
    with RepoServer(repo) as srv:
        srv.faults.truncate_next = 1
        srv.faults.fail_next = 1
        res = fetch(host, WANT, [srv.url], public_key=pub)
        pkg_reqs = [r for r in srv.faults.requests if r[0].endswith(".tar.zst")]
    assert res.sha256 in res.package.name and res.attempts == 3
    statuses = [s for _, _, s in pkg_reqs]
    assert statuses == [503, 200, 206], pkg_reqs           # the resumed request asked for the rest only
    assert pkg_reqs[2][1].startswith("bytes=") and int(pkg_reqs[2][1][6:-1]) > 0
    assert fetch_mod.sha256_of(res.package) == res.sha256


def test_fetch_truncated_forever_fails_cleanly(host, repo, pub):
    with RepoServer(repo) as srv:
        srv.faults.fail_next = 100
        with pytest.raises(PackageError, match="failed after 2 attempts: HTTP 503"):
            fetch(host, WANT, [srv.url], attempts=2, public_key=pub)
    cache = Path(host.base) / "var/cache/driverd/packages"
    assert [p for p in cache.iterdir() if not p.name.startswith(".")] == []


def test_fetch_wrong_sha256(tmp_path, host, repo):
    d = tmp_path / "r"
    shutil.copytree(repo, d)
    idx = json.loads((d / INDEX_NAME).read_text())
    for p in idx["packages"]:
        p["sha256"] = "0" * 64 if p["driver"] == "535.261.03" and p["kernel_release"] == REL else p["sha256"]
    (d / INDEX_NAME).write_text(json.dumps(idx))
    with RepoServer(d) as srv:     # (the edited index is no longer signed: accepted as insecure, with a warning)
        with pytest.raises(PackageError, match=r"has sha256 [0-9a-f]{64}, expected 0{64} \(from http"):
            fetch(host, WANT, [srv.url], insecure=True)
    cache = Path(host.base) / "var/cache/driverd/packages"
    assert list(cache.iterdir()) == []


def test_fetch_not_found_names_package_and_places(host, repo, tmp_path, pub):
    with RepoServer(repo) as srv:
        with pytest.raises(PackageError) as ei:
            fetch(host, Want("580.82.07", "open", REL, "x86_64"), [srv.url, f"file://{tmp_path}/nowhere"],
                  no_build_reason="packages.source is not set", public_key=pub)
    line = ei.value.one_line()
    assert "no package driverd-580.82.07-open-6.1.0-47-cloud-amd64-x86_64 found in:" in line
    assert f"{srv.url} (index lists 3 packages, not this one)" in line
    assert "nowhere/index.json" in line and "packages.source is not set" in line


def test_fetch_falls_back_to_local_build(host, repo, tmp_path):
    built = make_fake_package(tmp_path / "b", "580.82.07", REL)

    def builder(cache: Path) -> Path:
        dst = cache / built.path.name
        shutil.copy(built.path, dst)
        return dst
    res = fetch(host, Want("580.82.07", "open", REL, "x86_64"), [f"file://{repo}"], builder=builder)
    assert res.source == "local-build" and res.sha256 == built.sha256


def test_signed_index(tmp_path, host, repo):
    d = tmp_path / "r"
    shutil.copytree(repo, d)
    key, pub = make_index_key(tmp_path / "k")
    write_index(d, sign_key=str(key))
    assert fetch(host, WANT, [f"file://{d}"], public_key=str(pub)).sha256
    idx = (d / INDEX_NAME).read_bytes()
    (d / INDEX_NAME).write_bytes(idx.replace(b'"size": ', b'"size":  ', 1))   # same meaning, other bytes
    with pytest.raises(PackageError, match="has a bad signature"):
        fetch(host, WANT, [f"file://{d}"], public_key=str(pub))
    (d / "index.json.sig").unlink()
    with pytest.raises(PackageError, match="is not signed"):
        fetch(host, WANT, [f"file://{d}"], public_key=str(pub))


def test_cache_is_size_bounded(tmp_path):
    c = tmp_path / "c"
    c.mkdir()
    for i in range(5):
        p = c / f"p{i}"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))
    os.symlink(c / "p4", c / "link")                # not a cache file: neither counted nor removed
    removed = prune_cache(Root(tmp_path), "/c", 2500, keep="p0")
    assert sorted(removed) == ["p1", "p2", "p3"]
    assert sorted(os.listdir(c)) == ["link", "p0", "p4"]


def test_parse_index_rejects_escaping_paths():
    bad = {"schema": 1, "packages": [{"driver": "535.261.03", "flavor": "open", "kernel_release": REL,
                                      "arch": "x86_64", "sha256": "a" * 64, "size": 1, "path": "../../etc/shadow"}]}
    with pytest.raises(PackageError, match="leaves the repository"):
        parse_index(json.dumps(bad), "test")


def test_cli_repo_index_fetch_install(tmp_path, repo, host, index_key):
    d = tmp_path / "r"
    shutil.copytree(repo, d)
    r = run_cli("repo", "index", str(d), "--sign-key", str(index_key[0]), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["packages"] == 3
    # the node's public key is a host path, read under --root
    cfgdir = Path(host.base) / "etc/driverd"
    cfgdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(index_key[1], cfgdir / "repo.pub")
    (cfgdir / "config.toml").write_text('[packages]\nindex_public_key = "/etc/driverd/repo.pub"\n')
    with RepoServer(d) as srv:
        r = run_cli("fetch", "--root", host.base, "--driver", "535.261.03", "--flavor", "open",
                    "--repo", srv.url, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["source"] == srv.url and Path(out["package"]).is_file()
    r = run_cli("install", "--root", host.base, out["package"])
    assert r.returncode == 0, r.stderr
    r = run_cli("fetch", "--root", host.base, "--driver", "999.1.1", "--flavor", "open", "--repo", f"file://{d}")
    assert r.returncode == 3
    assert "no package driverd-999.1.1-open-6.1.0-47-cloud-amd64-x86_64 found in" in r.stderr
    assert "packages.source is not set" in r.stderr


def test_local_build_fallback_decision(tmp_path):
    """fetch builds locally only when a source of the wanted version and the kernel's headers exist."""
    from driverd.config import Config
    from driverd.build.modules import local_builder
    root = Root(write_host(tmp_path / "h", HostSpec(release=REL)))
    want = Want("535.261.03", "open", REL, "x86_64")

    def cfg(**kv):
        return Config({}).with_overrides({f"packages.{k}": v for k, v in kv.items()})
    b, why = local_builder(root, cfg(), want, Runner())
    assert b is None and why == "packages.source is not set (no driver source to build from)"
    b, why = local_builder(root, cfg(source="/usr/src/none.tar.xz"), want, Runner())
    assert b is None and why == "driver source /usr/src/none.tar.xz does not exist"
    src = Path(root.base) / "usr/src/nv/modules/nvidia-open-kernel"
    (src / "nvidia").mkdir(parents=True)
    (src / "Makefile").write_text("")
    (src / "Kbuild").write_text('ccflags-y += -DNV_VERSION_STRING=\\"535.261.03\\"\n')
    b, why = local_builder(root, cfg(source="/usr/src/nv"), want, Runner())
    assert b is None and why.startswith(f"kernel headers for {REL} not found")
    hdr = Path(root.base) / f"usr/src/linux-headers-{REL}"
    hdr.mkdir(parents=True, exist_ok=True)
    (hdr / "Makefile").write_text("")
    (hdr / ".config").write_text("CONFIG_X86_64=y\n")
    b, why = local_builder(root, cfg(source="/usr/src/nv"), want, Runner())
    assert b is not None and why is None
    b, why = local_builder(root, cfg(source="/usr/src/nv"), Want("550.127.05", "open", REL, "x86_64"), Runner())
    assert b is None and why == "packages.source /usr/src/nv is driver 535.261.03, not 550.127.05"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connecting is refused."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_repository_is_a_connection_failure_not_a_missing_package(host, repo, capsys):
    """Issue 32: a refused connection was reported as "no repository holds a package for this kernel … fix:
    build it". It names the URL, the error in words and the fix for a connection; each retry is said."""
    from driverd.repo.http import Unreachable
    url = f"http://127.0.0.1:{_closed_port()}/"
    with pytest.raises(Unreachable) as ei:
        fetch(host, WANT, [url], attempts=2, no_build_reason="packages.source is not set")
    line = ei.value.one_line()
    assert line.startswith(f"cannot reach the package repository: {url} (")
    assert "connection refused" in line and "HTTPConnectionPool" not in line and "NewConnectionError" not in line
    assert "build it" not in line and "no repository holds" not in line
    assert "check the URL" in line and "HTTPS_PROXY" in line
    err = capsys.readouterr().err
    assert f"GET {url}index.json: connection refused; retrying in" in err and "(attempt 2 of 2)" in err
    # one answering repository without the package, one unreachable: both said, the build fix kept
    with pytest.raises(PackageError) as ei:
        fetch(host, Want("580.82.07", "open", REL, "x86_64"), [url, f"file://{repo}"], attempts=1)
    line = ei.value.one_line()
    assert not isinstance(ei.value, Unreachable)
    assert f"{url} (GET {url}index.json failed after 1 attempt: connection refused)" in line
    assert f"file://{repo} (index lists 3 packages, not this one)" in line
    assert "1 of 2 could not be read" in line and "build it" in line and f"check {url}" in line


def test_repository_urls_driverd_cannot_fetch_are_refused_in_one_line(host, tmp_path):
    """`--repo ftp://…` ended in an "unexpected error" traceback line and the config accepted ftp:// and
    typos: both are refused naming the value, where it came from and what is allowed."""
    for bad in ("ftp://mirror/driverd", "htps://repo.example/driverd"):
        r = run_cli("fetch", "--root", host.base, "--driver", "535.261.03", "--flavor", "open", "--repo", bad)
        assert r.returncode == 2, r.stderr
        [line] = r.stderr.splitlines()
        assert line.startswith(f"driverd: error: --repo {bad}: driverd cannot fetch over ") and "unexpected" not in line
        assert "https://HOST/PATH, http://HOST/PATH, file:///PATH or an absolute directory" in line
    cfg = Path(host.base) / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    for bad in ("ftp://mirror/driverd", "htps://x", "file://server/share", "relative/dir"):
        cfg.write_text(f'[packages]\nrepositories = ["file:///srv/driverd", "{bad}"]\n')
        r = run_cli("config", "--root", host.base)
        assert r.returncode == 2
        [line] = r.stderr.splitlines()
        assert f"invalid value '{bad}' for packages.repositories in {cfg}" in line and "https://HOST/PATH" in line
    cfg.write_text('[packages]\nrepositories = ["https://u:p@repo.example:8443/d", "http://10.0.0.1/d", '
                   '"file:///srv/driverd", "file://localhost/srv/d", "/srv/driverd"]\n')
    assert run_cli("config", "--root", host.base).returncode == 0
    # a relative --repo directory is the shell user's: made absolute, then read
    r = run_cli("fetch", "--root", host.base, "--driver", "999.1.1", "--flavor", "open", "--repo",
                os.path.relpath(tmp_path), "--no-build")
    assert r.returncode == 3 and f"cannot read the package repository: {tmp_path} (" in r.stderr
