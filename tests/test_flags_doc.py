"""docs/flags.md against every parser (issue 48: one vocabulary): each flag of `driverd` and `kubectl driverd`
is in the table and no flag is there that no command has; a flag names its value one way everywhere (its
metavar: one meaning, one spelling of what it takes); each old spelling is listed with the new one and, used,
still works and prints one warning line naming it; the configuration keys the table names exist."""
from __future__ import annotations

import argparse
import re

from driverd.cli import build_parser, kubectl_parser
from driverd.cli.options import Deprecated
from tests.conftest import REPO, run_cli

DOC = REPO / "docs/flags.md"


def _actions() -> list[tuple[str, argparse.Action]]:
    out: list[tuple[str, argparse.Action]] = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{path} {name}")
            elif a.option_strings and "--help" not in a.option_strings:
                out.append((path, a))
    walk(build_parser(), "driverd")
    walk(kubectl_parser(), "kubectl driverd")
    return out


def _section(title: str) -> list[list[str]]:
    text = DOC.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]] for ln in text.splitlines()
            if ln.startswith("| ") and not ln.startswith("| flag |") and not ln.startswith("| old |")]


def test_every_flag_is_in_the_table_and_the_table_has_no_other():
    have = {s for _, a in _actions() if not isinstance(a, Deprecated) for s in a.option_strings}
    listed = {s for row in _section("Every flag") for s in re.findall(r"`(-{1,2}[\w-]+)`", row[0])}
    assert sorted(have - listed) == [], "flags missing from docs/flags.md"
    assert sorted(listed - have) == [], "docs/flags.md lists flags no command has"
    assert all(row[1] for row in _section("Every flag")), "a flag without its meaning"


def test_a_flag_names_its_value_one_way_everywhere():
    named: dict[str, set] = {}
    for _, a in _actions():
        if not isinstance(a, Deprecated):
            for s in a.option_strings:
                named.setdefault(s, set()).add(a.metavar)
    assert {s: m for s, m in named.items() if len(m) > 1} == {}


def test_every_old_spelling_is_listed_with_the_new_one_and_warns():
    rows = _section("Old spellings")
    listed = {(re.findall(r"`(-{1,2}[\w-]+)`", r[0])[0], re.findall(r"`(--[\w-]+)`", r[2])[0]) for r in rows}
    seen = set()
    for cmd, a in _actions():
        if isinstance(a, Deprecated):
            seen.add((a.option_strings[0], a.new))
            ns = argparse.Namespace()
            a(None, ns, "x" if a.nargs != 0 else None, a.option_strings[0])
            (line,) = ns.deprecated
            assert line.startswith(f"driverd: warning: {a.option_strings[0]} is deprecated") and \
                line.endswith(f"use {a.new}"), (cmd, line)
    assert seen == listed


def test_an_old_spelling_still_works_end_to_end(tmp_path):
    from driverd.sim.scenario import dgx_spec, make_host
    host = make_host(tmp_path / "h", dgx_spec(gpus=1, nvswitches=0, nic=False, nouveau=False))
    out = tmp_path / "c.tar.gz"
    r = run_cli("debug", "capture-host", "--root", str(host), "--out", str(out))
    assert r.returncode == 0 and out.is_file(), r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "deprecated" in ln]
    assert warned == ["driverd: warning: --out is deprecated here (--out names a directory in build and "
                      "build-matrix): use --archive"], r.stderr


def test_the_configuration_keys_the_table_names_exist():
    from driverd.config import SCHEMA
    keys = {k for row in _section("Flags and configuration keys") for k in re.findall(r"`([a-z_]+\.[a-z_.]+)", row[1])}
    assert keys and sorted(keys - set(SCHEMA)) == []
