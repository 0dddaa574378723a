"""The driver's one home (issue 45; docs/architecture.md, "One home for the driver"): sizes that keep
driverd readable, and the readers only driver/ may be."""
from __future__ import annotations

import ast
from collections import Counter

from tests.conftest import REPO

PKG = REPO / "driverd"
MAX_FILE_LINES = 600
MAX_FOLDER_SHARE = 0.15


def _lines(p) -> int:
    return len(p.read_text().splitlines())


def test_no_file_of_driverd_is_over_600_lines():
    big = {str(p.relative_to(REPO)): n for p in PKG.rglob("*.py") if (n := _lines(p)) > MAX_FILE_LINES}
    assert not big, big


def test_no_folder_holds_more_than_15_percent_of_driverd():
    per: Counter[str] = Counter()
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).parts
        per[rel[0] if len(rel) > 1 else "(top)"] += _lines(p)
    total = sum(per.values())
    over = {d: f"{n / total:.1%}" for d, n in per.items() if n > MAX_FOLDER_SHARE * total}
    assert not over, over


def _constants(path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def _holders(values: set[str], allowed: set[str]) -> list[str]:
    out = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(REPO))
        if rel in allowed or rel.startswith("driverd/sim/"):        # the simulator writes what the kernel would
            continue
        out += [f"{rel}:{line} {v!r}" for line, v in _constants(p) if v in values]
    return out


def test_only_driver_ident_names_the_kernels_version_file():
    """Only driver/ident.py parses /proc/driver/nvidia/version: everybody else asks it (or DriverState)."""
    assert not _holders({"/proc/driver/nvidia/version"}, {"driverd/driver/ident.py"})


def test_only_driver_names_the_records_of_the_driver():
    """The records of what the host converged to and runs are named in driver/layout.py only: readers go
    through driver/state.py, writers take the paths from the layout."""
    names = {"converged.json", "daemon/converged.json", "node-driver.json", "updates/driverd", "install.json"}
    assert not _holders(names, {"driverd/driver/layout.py"})


def test_the_driver_and_the_formats_sit_low():
    """driver/ and package/ import nothing above them: below the host's facts, the runtimes and every
    layer that changes a host (the layer test checks each import against this order)."""
    from tests.test_architecture import LAYERS
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    assert rank["root"] < rank["package"] < rank["driver"] < rank["runtime"] < rank["host"]
    assert rank["driver"] < rank["repo"] < rank["build"] < rank["install"] < rank["apply"]


def test_one_engine_writes_the_switch_records_of_every_part():
    """Every change to a driver tree goes through install/store.py: the pending marker and the previous
    record (their fields "set_previous", "replaced_by") are written there only; the parts supply their
    layout and their activate/verify hooks (install/modules.py's ModulesPart, install/userspace.py's
    UserspacePart)."""
    assert not _holders({"set_previous", "replaced_by"}, {"driverd/install/store.py"})
    from driverd.install.modules import ModulesPart
    from driverd.install.store import Part
    from driverd.install.userspace import UserspacePart
    assert issubclass(ModulesPart, Part) and issubclass(UserspacePart, Part)
    for p in (PKG / "install").glob("*.py"):
        names = {n.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef)}
        if p.name != "store.py":        # the protocol's own steps, written once
            assert not names & {"_switch_back", "_redrive", "_verify_and_back"}, p


def test_no_prefix_families_where_a_folder_says_it():
    """Names are nouns of the domain: no `userspace_*.py` family beside `userspace.py` (a folder says it);
    cli's `<group>_cmds.py` (one file per command group) is the one suffix convention."""
    fam: dict[tuple, list[str]] = {}
    for p in PKG.rglob("*.py"):
        if p.stem != "__init__" and "_" in p.stem and not p.stem.endswith("_cmds") and "__pycache__" not in p.parts:
            fam.setdefault((p.parent, p.stem.split("_")[0]), []).append(p.stem)
    bad = {f"{d.relative_to(REPO)}/{k}_*": v for (d, k), v in fam.items() if len(v) > 1 or (d / f"{k}.py").exists()}
    assert not bad, bad
