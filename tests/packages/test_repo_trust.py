"""Authentic, fresh repositories: a tampered index, the wrong key, a replayed older serial, an expired
index and an unsigned index over http are each refused by `driverd fetch` with one line, and nothing
is written (no cache, no recorded serial). file:// unsigned and packages.insecure are accepted, the
latter with a warning at every use."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from driverd.repo.index import INDEX_NAME, write_index
from driverd.repo.trust import STATE_SUBDIR
from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import HostSpec, write_host
from driverd.sim.httprepo import RepoServer
from driverd.sim.scenario import make_index_key
from tests.conftest import run_cli

REL = "6.1.0-47-cloud-amd64"
pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    return {"good": make_index_key(base / "good"), "other": make_index_key(base / "other")}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    d = tmp_path_factory.mktemp("pkgs")
    make_fake_package(d, "535.261.03", REL)
    return d


@pytest.fixture
def repo(tmp_path, packages, keys):
    d = tmp_path / "repo"
    shutil.copytree(packages, d)
    write_index(d, sign_key=str(keys["good"][0]))
    return d


def _host(tmp_path: Path, pub: Path | None, extra: str = "") -> Path:
    host = write_host(tmp_path / "host", HostSpec(release=REL))
    (host / "etc/driverd").mkdir(parents=True, exist_ok=True)
    cfg = "[packages]\nbuild_fallback = false\n" + extra
    if pub is not None:
        shutil.copy(pub, host / "etc/driverd/repo.pub")          # a host path: read under --root
        cfg += 'index_public_key = "/etc/driverd/repo.pub"\n'
    (host / "etc/driverd/config.toml").write_text(cfg)
    return host


def _fetch(host: Path, url: str):
    return run_cli("fetch", "--root", str(host), "--driver", "535.261.03", "--flavor", "open", "--repo", url)


def _written(host: Path) -> list[str]:
    out = []
    for d in ("var/cache/driverd", f"var/lib/driverd/{STATE_SUBDIR}"):
        p = host / d
        if p.exists():
            out += [str(x.relative_to(host)) for x in p.rglob("*") if x.is_file()]
    return sorted(out)


def _refused(r, *words: str) -> str:
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_signed_fresh_index_is_accepted_and_its_serial_recorded(tmp_path, repo, keys):
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        r = _fetch(host, srv.url)
    assert r.returncode == 0, r.stderr
    [state] = (host / "var/lib/driverd" / STATE_SUBDIR).iterdir()
    serial = json.loads((repo / INDEX_NAME).read_text())["serial"]
    assert json.loads(state.read_text())["serial"] == serial


def test_tampered_index(tmp_path, repo, keys):
    idx = (repo / INDEX_NAME).read_bytes()
    (repo / INDEX_NAME).write_bytes(idx.replace(b'"size": ', b'"size":  ', 1))     # same meaning, other bytes
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        _refused(_fetch(host, srv.url), "has a bad signature")
    assert _written(host) == []


def test_wrong_key(tmp_path, repo, keys):
    write_index(repo, sign_key=str(keys["other"][0]))
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        _refused(_fetch(host, srv.url), "has a bad signature", "does not verify against")
    assert _written(host) == []


def test_replayed_older_serial(tmp_path, repo, keys):
    host = _host(tmp_path, keys["good"][1])
    old_index = (repo / INDEX_NAME).read_bytes(), (repo / "index.json.sig").read_bytes()
    write_index(repo, sign_key=str(keys["good"][0]))                     # the repository moves on
    with RepoServer(repo) as srv:                                        # (one URL: the state is per repository)
        assert _fetch(host, srv.url).returncode == 0
        (repo / INDEX_NAME).write_bytes(old_index[0])                    # a mirror replays the old one
        (repo / "index.json.sig").write_bytes(old_index[1])
        shutil.rmtree(host / "var/cache/driverd")                        # even with nothing cached
        before = {p: (host / p).read_bytes() for p in _written(host)}
        line = _refused(_fetch(host, srv.url), "older than serial", "this node has already seen")
    assert "rollback" in line
    assert {p: (host / p).read_bytes() for p in _written(host)} == before


def test_expired_index(tmp_path, repo, keys):
    write_index(repo, sign_key=str(keys["good"][0]), expires="2020-01-01T00:00:00+00:00")
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        _refused(_fetch(host, srv.url), "expired at 2020-01-01T00:00:00+00:00", "freeze")
    assert _written(host) == []


def test_unsigned_over_http(tmp_path, repo):
    (repo / "index.json.sig").unlink()
    host = _host(tmp_path, None)
    with RepoServer(repo) as srv:
        _refused(_fetch(host, srv.url), "is not authenticated", "packages.index_public_key")
    assert _written(host) == []


def test_signature_missing_when_a_key_is_configured(tmp_path, repo, keys):
    (repo / "index.json.sig").unlink()
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        _refused(_fetch(host, srv.url), "is not signed")
    assert _written(host) == []


def test_insecure_is_logged_at_every_use(tmp_path, repo):
    (repo / "index.json.sig").unlink()
    host = _host(tmp_path, None, "insecure = true\n")
    with RepoServer(repo) as srv:
        for _ in range(2):
            r = _fetch(host, srv.url)
            assert r.returncode == 0, r.stderr
            assert "accepting the UNSIGNED repository index" in r.stderr


def test_file_repository_unsigned_is_accepted(tmp_path, repo):
    (repo / "index.json.sig").unlink()
    host = _host(tmp_path, None)
    r = _fetch(host, f"file://{repo}")
    assert r.returncode == 0 and "UNSIGNED" not in r.stderr, r.stderr


def test_repo_index_serial_only_grows(tmp_path, packages):
    d = tmp_path / "r"
    shutil.copytree(packages, d)
    a = write_index(d).serial
    b = write_index(d).serial
    assert b > a
    r = run_cli("repo", "index", str(d), "--valid-days", "1", "--json")
    out = json.loads(r.stdout)
    assert out["serial"] > b and out["expires"] and out["signed"] is False


# -- freshness is keyed by the signing key, not the URL (issue 30) ----------------------------------

def _serve_copy(tmp_path: Path, repo: Path, name: str, index: tuple[bytes, bytes]) -> Path:
    """A second repository directory (another URL) serving the packages with the given index."""
    d = tmp_path / name
    shutil.copytree(repo, d)
    (d / INDEX_NAME).write_bytes(index[0])
    (d / "index.json.sig").write_bytes(index[1])
    return d


def test_an_old_index_is_refused_under_another_url(tmp_path, repo, keys):
    """The node has seen serial N from one URL; an index signed by the same key with a serial below
    N, served from a different URL (another mirror, a second repository entry), is a replay."""
    host = _host(tmp_path, keys["good"][1])
    old_index = (repo / INDEX_NAME).read_bytes(), (repo / "index.json.sig").read_bytes()
    write_index(repo, sign_key=str(keys["good"][0]))                     # the repository moves on
    mirror = _serve_copy(tmp_path, repo, "mirror", old_index)           # a mirror still has the old one
    with RepoServer(repo) as srv:
        assert _fetch(host, srv.url).returncode == 0
    shutil.rmtree(host / "var/cache/driverd")
    before = {p: (host / p).read_bytes() for p in _written(host)}
    with RepoServer(mirror) as other:
        line = _refused(_fetch(host, other.url), "older than serial", "signed by key sha256:")
    assert "rollback" in line and "another one" in line
    line = _refused(_fetch(host, f"file://{mirror}"), "older than serial")   # any URL, file:// too
    assert {p: (host / p).read_bytes() for p in _written(host)} == before
    [state] = (host / "var/lib/driverd" / STATE_SUBDIR).iterdir()
    assert state.name.startswith("key-") and json.loads(state.read_text())["key"].startswith("sha256:")


def test_another_key_has_its_own_sequence(tmp_path, repo, keys):
    """A node whose packages.index_public_key changes starts the new key's sequence afresh."""
    host = _host(tmp_path, keys["good"][1])
    with RepoServer(repo) as srv:
        assert _fetch(host, srv.url).returncode == 0
    from driverd.repo.trust import key_fingerprint
    fps = {key_fingerprint(str(keys[k][1])) for k in ("good", "other")}
    assert len(fps) == 2
    names = {p.name for p in (host / "var/lib/driverd" / STATE_SUBDIR).iterdir()}
    assert names == {f"key-{key_fingerprint(str(keys['good'][1]))[7:]}.json"}


def test_fingerprint_is_the_spki_sha256_in_any_encoding(tmp_path, keys):
    import hashlib
    import subprocess
    from driverd.repo.trust import key_fingerprint
    pub = str(keys["good"][1])
    der = subprocess.run(["openssl", "pkey", "-pubin", "-in", pub, "-outform", "DER"], capture_output=True,
                         check=True).stdout
    assert key_fingerprint(pub) == "sha256:" + hashlib.sha256(der).hexdigest()
    (tmp_path / "k.der").write_bytes(der)                       # not PEM: read through openssl pkey
    assert key_fingerprint(str(tmp_path / "k.der")) == key_fingerprint(pub)
    (tmp_path / "junk").write_text("not a key\n")
    from driverd.repo.trust import IndexRefused
    with pytest.raises(IndexRefused, match="cannot be read as a public key"):
        key_fingerprint(str(tmp_path / "junk"))


def test_state_of_earlier_versions_is_taken_over(tmp_path, repo, keys):
    """A node upgraded from per-URL state: the highest serial any URL recorded is the one seen, so
    an old index is refused on the first fetch after the upgrade; the per-URL files give way to the
    key's own file once a fresh index is accepted."""
    import hashlib
    host = _host(tmp_path, keys["good"][1])
    old_index = (repo / INDEX_NAME).read_bytes(), (repo / "index.json.sig").read_bytes()
    write_index(repo, sign_key=str(keys["good"][0]))
    seen = json.loads((repo / INDEX_NAME).read_text())["serial"]
    state = host / "var/lib/driverd" / STATE_SUBDIR
    state.mkdir(parents=True)
    legacy = state / (hashlib.sha256(b"https://elsewhere.invalid/repo").hexdigest()[:16] + ".json")
    legacy.write_text(json.dumps({"url": "https://elsewhere.invalid/repo", "serial": seen}))
    mirror = _serve_copy(tmp_path, repo, "mirror", old_index)
    _refused(_fetch(host, f"file://{mirror}"), "older than serial", str(seen))
    assert [p.name for p in state.iterdir()] == [legacy.name]          # a refusal writes nothing
    assert _fetch(host, f"file://{repo}").returncode == 0
    [now] = state.iterdir()
    assert now.name.startswith("key-") and json.loads(now.read_text())["serial"] == seen
