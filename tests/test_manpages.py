"""The man pages the systemd units name (issue 32, item 9): every Documentation= URI is a man page driverd
ships (man/, installed by README's Install commands), generated from the commands' own --help and not
stale, and readable by man without warnings."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, require_binary

sys.path.insert(0, str(REPO / "tools"))
import gen_manpages  # noqa: E402


def _install_lines() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip().startswith("install ")]


def test_every_documentation_uri_is_a_shipped_and_installed_man_page():
    units = sorted((REPO / "systemd").glob("*.service"))
    assert units
    installs = _install_lines()
    for unit in units:
        docs = [u for ln in unit.read_text().splitlines() if ln.startswith("Documentation=")
                for u in ln.split("=", 1)[1].split()]
        assert docs, f"{unit.name} has no Documentation="
        for uri in docs:
            m = re.fullmatch(r"man:([\w.-]+)\((\d)\)", uri)
            assert m, f"{unit.name}: {uri} is not a man page driverd ships"
            name, section = m.groups()
            page = REPO / "man" / f"{name}.{section}"
            assert page.is_file(), f"{unit.name}: {uri}: no {page.relative_to(REPO)}"
            assert any(f"man/{name}.{section} " in ln and f"/share/man/man{section}/{name}.{section}" in ln
                       for ln in installs), f"README's Install does not install {page.relative_to(REPO)}"


@pytest.mark.parametrize("name", sorted(gen_manpages.PAGES))
def test_man_pages_are_what_the_parsers_say(name):
    shipped = (REPO / "man" / name).read_text()
    assert gen_manpages.undated(shipped) == gen_manpages.undated(gen_manpages.render(name)), \
        "stale man page: run python3 tools/gen_manpages.py"


@pytest.mark.parametrize("name", sorted(gen_manpages.PAGES))
def test_man_reads_them_without_warnings(name):
    man = require_binary("man")
    r = subprocess.run([man, "--warnings", "-l", str(REPO / "man" / name)], capture_output=True, text=True,
                       env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin", "MANPAGER": "cat", "PAGER": "cat"},
                       timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    text = r.stdout
    if name == "driverd.8":
        assert "driverd - take NVIDIA GPU hosts to workload-ready" in text
        for cmd in ("detect", "plan", "apply", "daemon", "completion", "build-matrix"):
            assert f"driverd {cmd}" in text
    else:
        assert "kubectl driverd rollout start" in text
