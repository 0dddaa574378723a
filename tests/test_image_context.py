"""images/Dockerfile and .dockerignore (issue 21): the build context holds only what driverd's wheel
is built from — never .git, .venv, .sandbox/ (the demo's private index key) or caches — and the
image installs from wheels only, with no source tree in any layer. No container engine runs here,
so .dockerignore is evaluated with Docker's rules (moby's patternmatcher: later rules win, `!`
re-includes, a pattern matching a parent directory matches what is inside it), and the wheel stage's
command is run on exactly the context those rules leave."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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
    for p in ("pyproject.toml", "README.md", "driverd/cli/__init__.py", "driverd/data/gpus.json"):
        assert not excluded(p), p
    ctx = _context()                                    # the real tree, .venv and .git included
    assert ctx and all(p in ("pyproject.toml", "README.md") or p.startswith("driverd/") for p in ctx), \
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
    assert sorted(s for c in copies for s in c) == ["README.md", "driverd", "pyproject.toml"]
    assert not [ln for ln in final if ln.upper().startswith(("COPY ", "ADD "))]     # no layer with sources
    (install,) = [ln for ln in final if "pip install" in ln]
    assert "--mount=type=bind,from=wheels" in install and "--no-index" in install and "--only-binary=:all:" in install


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
