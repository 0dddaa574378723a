"""images/Dockerfile and .dockerignore (issue 21): the build context holds only what driverd's wheel
is built from (and the hashed requirements) — never .git, .venv, .sandbox/ (the demo's private index
key) or caches — and the image installs from wheels only, with no source tree in any layer. No
container engine runs here, so .dockerignore is evaluated with Docker's rules (moby's patternmatcher:
later rules win, `!` re-includes, a pattern matching a parent directory matches what is inside it),
and the wheel stage's command is run on exactly the context those rules leave.

Issue 30: nothing an image build pulls may move under it — the base image is named by digest, every
Python package is pinned and installed with --require-hashes from images/requirements*.txt (made by
tools/pin_image_requirements.py from the pinned versions), and `build-image.sh --packages` bakes in
only the repository index and the package files it names (images/bake-packages.py)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


def _rules() -> list[tuple[bool, re.Pattern]]:
    out = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line[1:] if neg else line
        pat = pat.strip("/")
        rx = ""
        i = 0
        while i < len(pat):
            if pat.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif pat.startswith("**", i):
                rx += ".*"
                i += 2
            elif pat[i] == "*":
                rx += "[^/]*"
                i += 1
            elif pat[i] == "?":
                rx += "[^/]"
                i += 1
            elif pat[i] == "[":
                j = pat.index("]", i)
                rx += pat[i:j + 1]
                i = j + 1
            else:
                rx += re.escape(pat[i])
                i += 1
        out.append((neg, re.compile(rx + r"\Z")))
    return out


def excluded(path: str, rules=None) -> bool:
    rules = rules if rules is not None else _rules()
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ex = False
    for neg, rx in rules:
        if any(rx.match(p) for p in prefixes):
            ex = not neg
    return ex


def _context() -> list[str]:
    rules = _rules()
    out = []
    for d, dirs, files in os.walk(REPO):
        rel_d = os.path.relpath(d, REPO)
        for f in files:
            rel = f if rel_d == "." else f"{rel_d}/{f}"
            if not excluded(rel, rules):
                out.append(rel)
    return sorted(out)


def test_dockerignore_leaves_only_the_wheel_sources():
    for p in (".git/config", ".venv/bin/python", ".sandbox/index-key.pem", ".sandbox/x/y", "tests/conftest.py",
              "driverd/__pycache__/x.cpython-311.pyc", "driverd/cli/__pycache__/a.pyc", "driverd.egg-info/PKG-INFO",
              ".pytest_cache/v", "bench/fleet.py", "kernels/debian-bookworm.toml", "images/Dockerfile", "docs/x.md"):
        assert excluded(p), p
    for p in ("pyproject.toml", "README.md", "driverd/cli/__init__.py", "driverd/data/gpus.json",
              "images/requirements.txt", "images/requirements-build.txt"):
        assert not excluded(p), p
    for p in ("images/requirements.in", "images/bake-packages.py", "tools/pin_image_requirements.py"):
        assert excluded(p), p
    ctx = _context()                                    # the real tree, .venv and .git included
    allowed = ("pyproject.toml", "README.md", "images/requirements.txt", "images/requirements-build.txt")
    assert ctx and all(p in allowed or p.startswith("driverd/") for p in ctx), \
        [p for p in ctx if not p.startswith("driverd/")][:10]
    assert not [p for p in ctx if "__pycache__" in p or p.endswith(".pyc")]


def _stages() -> list[list[str]]:
    text = (REPO / "images/Dockerfile").read_text()
    logical = re.sub(r"\\\n\s*", " ", text)
    stages: list[list[str]] = []
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def test_the_image_installs_wheels_only_and_copies_no_source():
    build, final = _stages()
    assert build[0].split()[-1] == "wheels" and "pip wheel" in " ".join(build)
    copies = [ln.split()[1:-1] for ln in build if ln.upper().startswith("COPY ")]
    assert sorted(s for c in copies for s in c) == ["README.md", "driverd", "images/requirements-build.txt",
                                                      "images/requirements.txt", "pyproject.toml"]
    assert not [ln for ln in final if ln.upper().startswith(("COPY ", "ADD "))]     # no layer with sources
    (install,) = [ln for ln in final if "pip install" in ln]
    assert "--mount=type=bind,from=wheels" in install and "--no-index" in install and "--only-binary=:all:" in install
    assert "--require-hashes -r /wheels/requirements.txt -r /wheels/driverd.txt" in install


def test_the_wheel_stage_builds_from_that_context_alone(tmp_path):
    """The build stage's `pip wheel` on a copy of exactly the context .dockerignore leaves: the wheel
    builds, carries driverd's modules and data, and nothing from tests/ or the demo's sandbox."""
    ctx = tmp_path / "ctx"
    for rel in _context():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, ctx / rel)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--disable-pip-version-check", "-q", "-w", str(tmp_path / "w"), str(ctx)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp_path / "w").glob("driverd-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "driverd/cli/__init__.py" in names and "driverd/data/gpus.json" in names
    assert not [n for n in names if n.startswith(("tests/", ".sandbox", ".git")) or "__pycache__" in n]


# -- issue 30: nothing the build pulls can move under it ---------------------------------------------

def _base_images() -> list[str]:
    text = (REPO / "images/Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    return [re.sub(r"\$\{?(\w+)\}?", lambda m: args[m[1]], ref)
            for ref in re.findall(r"^FROM (\S+)", text, re.M)]


def test_the_base_image_is_named_by_digest():
    """A tag (debian:bookworm-slim) is re-pointed with every point release: two builds of one commit
    could start from two different images. A digest is one image."""
    bases = _base_images()
    assert len(bases) == 2 and len(set(bases)) == 1, bases
    assert re.fullmatch(r"debian:bookworm-slim@sha256:[0-9a-f]{64}", bases[0]), bases


def _pip_commands(text: str) -> list[str]:
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    logical = re.sub(r"\\\n\s*", " ", code)
    return [m.group(0) for m in re.finditer(r"(?:pip|-m pip)\s+(?:install|download|wheel)\b[^&|;\n]*", logical)]


def test_every_python_package_of_an_image_is_hashed():
    """images/Dockerfile and images/build-image.sh install or download Python packages only with
    --require-hashes from the generated requirement files; the one `pip wheel` builds driverd itself
    (no dependencies, the hashed setuptools, no build isolation fetching an unpinned backend); no
    unpinned `pip install --upgrade pip`."""
    for name in ("images/Dockerfile", "images/build-image.sh"):
        cmds = _pip_commands((REPO / name).read_text())
        assert cmds, name
        for c in cmds:
            if " wheel " in f" {c} ":
                assert "--no-deps" in c and "--no-build-isolation" in c, (name, c)
            else:
                assert "--require-hashes" in c and "-r " in c and "--upgrade" not in c, (name, c)
        assert "requirements-build.txt" in " ".join(cmds) and "requirements.txt" in " ".join(cmds), name


def test_the_pins_are_driverds_dependency_closure_and_every_pin_is_hashed():
    """requirements.txt holds exactly the pins of requirements.in, each with sha256 hashes
    (tools/pin_image_requirements.py --check); the pins satisfy pyproject.toml; and every requirement
    of a pinned package (as the installed distribution of that version declares it, for Linux and
    CPython 3.11) is pinned too — pip's hash-checking mode refuses anything unpinned."""
    import tomllib
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import pin_image_requirements as pins_tool
    finally:
        sys.path.pop(0)
    r = subprocess.run([sys.executable, str(REPO / "tools/pin_image_requirements.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pins = pins_tool.read_pins(REPO / "images/requirements.in")
    hashed = pins_tool.read_hashed(REPO / "images/requirements.txt")
    assert all(hs for _, hs in hashed.values())
    env = {"python_version": "3.11", "python_full_version": "3.11.2", "sys_platform": "linux",
           "platform_system": "Linux", "os_name": "posix", "platform_python_implementation": "CPython",
           "implementation_name": "cpython", "platform_machine": "x86_64", "extra": ""}
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    checked = 0
    for req in [Requirement(d) for d in deps]:
        key = pins_tool.canonical(req.name)
        assert key in pins and pins[key][1] in req.specifier, (req, pins.get(key))
    for key, (name, version) in pins.items():
        try:
            d = distribution(name)
        except PackageNotFoundError:
            continue
        if d.version != version:
            continue                      # this environment has another version: its metadata says nothing
        checked += 1
        for x in d.requires or []:
            req = Requirement(x)
            if req.marker and not req.marker.evaluate(env):
                continue
            dep = pins_tool.canonical(req.name)
            assert dep in pins, f"{name}=={version} requires {req}, which images/requirements.in does not pin"
            assert pins[dep][1] in req.specifier, (name, str(req), pins[dep])
    assert checked >= len(pins) // 2, "too few pinned versions installed here to check the closure"


def test_the_generator_hashes_the_wheels_it_is_given(tmp_path):
    """tools/pin_image_requirements.py turns pins and downloaded wheels into `--hash=sha256:` lines (the
    download itself is pip's; here the wheels are given) and refuses a pin with no wheel."""
    import hashlib
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import pin_image_requirements as pins_tool
    finally:
        sys.path.pop(0)
    (tmp_path / "w").mkdir()
    files = {"Foo_Bar-1.0-py3-none-any.whl": b"a", "foo_bar-1.0-cp311-cp311-manylinux2014_x86_64.whl": b"b",
             "baz-2.0-py3-none-any.whl": b"c"}
    for n, data in files.items():
        (tmp_path / "w" / n).write_bytes(data)
    (tmp_path / "r.in").write_text("# comment\nfoo-bar==1.0\nbaz==2.0  # why\n")
    text = pins_tool.render("r.in", pins_tool.read_pins(tmp_path / "r.in"), pins_tool.hashes_of(tmp_path / "w"))
    (tmp_path / "r.txt").write_text(text)
    got = pins_tool.read_hashed(tmp_path / "r.txt")
    sha = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    assert got == {"foo-bar": ("1.0", sorted([sha["Foo_Bar-1.0-py3-none-any.whl"],
                                              sha["foo_bar-1.0-cp311-cp311-manylinux2014_x86_64.whl"]])),
                   "baz": ("2.0", [sha["baz-2.0-py3-none-any.whl"]])}
    (tmp_path / "r.in").write_text("foo-bar==1.0\nqux==3\n")
    with pytest.raises(SystemExit, match="no wheel of qux==3"):
        pins_tool.render("r.in", pins_tool.read_pins(tmp_path / "r.in"), pins_tool.hashes_of(tmp_path / "w"))


def test_pip_refuses_a_wheel_whose_hash_is_not_the_pinned_one(tmp_path):
    """What --require-hashes buys: a file that is not the pinned one (here: a pin whose hash is
    wrong) stops the download. Uses the machine's own pip configuration, as the builds do."""
    name, (version, _) = "tenacity", _hashed("tenacity")
    (tmp_path / "r.txt").write_text(f"{name}=={version} --hash=sha256:{'0' * 64}\n")
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                        "--require-hashes", "-r", str(tmp_path / "r.txt"), "-d", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "DO NOT MATCH THE HASHES" in r.stderr, r.stdout + r.stderr
    assert not list((tmp_path / "d").glob("*.whl")) if (tmp_path / "d").exists() else True


def _hashed(name: str):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import pin_image_requirements as pins_tool
    finally:
        sys.path.pop(0)
    return pins_tool.read_hashed(REPO / "images/requirements.txt")[name]


def test_the_dockerfiles_python_stages_run_as_written(tmp_path):
    """No engine here: the Dockerfile's Python commands, exactly as written (its paths moved into a
    temporary directory), on Debian 12's own python3 and pip (what the base image has), in the context
    .dockerignore leaves — the wheels stage (hashed setuptools, driverd's wheel, the pinned wheels
    downloaded with --require-hashes) and the image's install from those wheels alone, which must
    give a working driverd."""
    py = Path("/usr/bin/python3")
    if not py.exists() or subprocess.run([str(py), "-c", "import sys, venv, ensurepip; "
                                          "assert sys.version_info[:2] == (3, 11)"]).returncode:
        pytest.skip("needs Debian 12's python3 (3.11) with venv, the base image's interpreter")
    ctx = tmp_path / "src"
    for rel in _context():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, ctx / rel)
    bindir = tmp_path / "path"
    bindir.mkdir()
    (bindir / "python3").symlink_to(py)
    subs = [("/wheels", str(tmp_path / "wheels")), ("/build", str(tmp_path / "build")),
            ("/opt/driverd", str(tmp_path / "opt")), ("/usr/local/bin", str(tmp_path / "bin"))]
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.pop("PIP_REQUIRE_VIRTUALENV", None)
    for stage in _stages():
        for ln in stage:
            if not ln.upper().startswith("RUN ") or "apt-get" in ln:
                continue                 # the base image's Debian packages: python3 and python3-venv are here
            cmd = re.sub(r"^RUN\s+(--mount=\S+\s+)*", "", ln)
            for a, b in subs:
                cmd = cmd.replace(a, b)
            r = subprocess.run(["sh", "-euc", cmd], cwd=ctx, env=env, capture_output=True, text=True, timeout=900)
            assert r.returncode == 0, cmd + "\n" + r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([str(tmp_path / "bin/driverd"), "gpus", "2330"], capture_output=True, text=True,
                       timeout=120, env={k: v for k, v in env.items() if not k.startswith("DRIVERD_")})
    assert r.returncode == 0 and "H100" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([str(tmp_path / "opt/bin/python"), "-c", "import kubernetes, zstandard, yaml, psutil"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


# -- build-image.sh --packages: the index and the packages it names, nothing else ------------------

def _repo(tmp_path: Path) -> Path:
    import hashlib
    import json
    repo = tmp_path / "repo"
    (repo / "6.1").mkdir(parents=True)
    pkgs = {"driverd-535-open.tar.zst": b"package one", "6.1/driverd-550-open.tar.zst": b"package two"}
    entries = []
    for rel, data in pkgs.items():
        (repo / rel).write_bytes(data)
        entries.append({"driver": rel, "flavor": "open", "kernel_release": "6.1", "arch": "x86_64",
                        "sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "path": rel})
    (repo / "index.json").write_text(json.dumps({"schema": 1, "serial": 7, "packages": entries}))
    (repo / "index.json.sig").write_bytes(b"signature bytes")
    (repo / "index-signing.key").write_text("-----BEGIN PRIVATE KEY-----\n")    # must never be baked
    (repo / "build.log").write_text("log\n")
    (repo / "driverd-999-open.tar.zst").write_bytes(b"not in the index")
    return repo


def _bake(repo: Path, out: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "images/bake-packages.py"), "--out", str(out), str(repo),
                           *names], capture_output=True, text=True, timeout=60)


def _tree(d: Path) -> list[str]:
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())


def test_packages_bakes_the_index_and_the_packages_it_names_only(tmp_path):
    repo = _repo(tmp_path)
    r = _bake(repo, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "out") == ["6.1/driverd-550-open.tar.zst", "driverd-535-open.tar.zst", "index.json",
                                       "index.json.sig"]
    assert (tmp_path / "out/index.json").read_bytes() == (repo / "index.json").read_bytes()   # signature holds
    line = r.stderr.strip()
    assert "\n" not in line and "baked 2 package(s)" in line and "left out 3 file(s)" in line
    assert "index-signing.key" in line
    r = _bake(repo, tmp_path / "one", "driverd-550-open.tar.zst")        # only the ones asked for
    assert r.returncode == 0, r.stderr
    assert _tree(tmp_path / "one") == ["6.1/driverd-550-open.tar.zst", "index.json", "index.json.sig"]


@pytest.mark.parametrize("case,words", [
    ("unlisted", "driverd-999-open.tar.zst is not a package"),
    ("symlink", "driverd-535-open.tar.zst is a symbolic link"),
    ("linked-dir", "/6.1 is a symbolic link"),
    ("tampered", "the index says 11 bytes"),
    ("escape", "a path that leaves the repository"),
    ("no-index", "index.json no such file or directory"),
])
def test_packages_refuses_anything_else_and_writes_nothing(tmp_path, case, words):
    import json
    repo = _repo(tmp_path)
    names: list[str] = []
    if case == "unlisted":
        names = ["driverd-999-open.tar.zst"]
    elif case == "symlink":
        (repo / "driverd-535-open.tar.zst").unlink()
        (repo / "driverd-535-open.tar.zst").symlink_to(tmp_path / "elsewhere")
    elif case == "linked-dir":
        (repo / "6.1").rename(tmp_path / "other")
        (repo / "6.1").symlink_to(tmp_path / "other")
    elif case == "tampered":
        (repo / "driverd-535-open.tar.zst").write_bytes(b"package 1")
    elif case == "escape":
        doc = json.loads((repo / "index.json").read_text())
        doc["packages"][0]["path"] = "../../etc/shadow"
        (repo / "index.json").write_text(json.dumps(doc))
    elif case == "no-index":
        (repo / "index.json").unlink()
    r = _bake(repo, tmp_path / "out", *names)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"build-image: refusing --packages {repo}: ") and words in line, line
    assert not (tmp_path / "out").exists()


def test_build_image_bakes_packages_through_the_check():
    text = (REPO / "images/build-image.sh").read_text()
    assert 'images/bake-packages.py --out "$work/packages" "$packages"' in text
    assert "cp -a" not in text and '"$packages"/.' not in text
