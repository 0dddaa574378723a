"""The shape docs/architecture.md promises: no import cycles between driverd's modules, production
code never imports driverd.sim (only the CLI's composition root does), no test hooks in production,
an explicit step registry, and a README that sends readers nowhere outside the repository."""
from __future__ import annotations

import ast
import re

from tests.conftest import REPO

PKG = REPO / "driverd"
COMPOSITION_ROOT = {"driverd/cli/context.py", "driverd/cli/lifecycle_cmds.py", "driverd/cli/host_cmds.py"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(p.read_text(), str(p))
    return out


def _imports(tree: ast.Module, mods: set[str]) -> set[str]:
    """Every driverd module a module imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("driverd"):
            sub = [a.name for a in node.names if f"{node.module}.{a.name}" in mods]
            out |= {f"{node.module}.{a}" for a in sub}
            if node.module in mods and len(sub) < len(node.names):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
    return out


def test_no_import_cycles():
    trees = _modules()
    graph = {m: _imports(t, set(trees)) for m, t in trees.items()}
    cycles = []

    def visit(m, path):
        for n in graph[m]:
            if n in path:
                cycles.append(path[path.index(n):] + [n])
            elif n not in done:
                visit(n, path + [n])
        done.add(m)
    done: set[str] = set()
    for m in sorted(graph):
        if m not in done:
            visit(m, [m])
    assert not cycles, cycles[:5]


def test_production_code_never_imports_the_simulator():
    offenders = []
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(REPO))
        if rel.startswith("driverd/sim/") or rel in COMPOSITION_ROOT:
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n and (n == "driverd.sim" or n.startswith("driverd.sim.")) for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders


def test_no_test_hooks_in_production_code():
    hits = [str(p.relative_to(REPO)) for p in PKG.rglob("*.py") if re.search(r"DRIVERD_TEST|FAULTS_", p.read_text())]
    assert not hits, hits


def test_step_registry_is_explicit():
    from driverd.apply.steps import REGISTRY
    from driverd.apply.step import StepImpl
    import driverd.apply.steps as steps
    declared = {c.action for c in vars(steps).values() if isinstance(c, type) and issubclass(c, StepImpl)
                and c.action and not c.__name__.startswith("_")}
    assert declared == set(REGISTRY), declared ^ set(REGISTRY)
    assert "def register" not in (PKG / "apply/executor.py").read_text()


def test_runtime_registry_is_explicit():
    """One table in runtime/registry.py, built from the runtime classes it names; nothing else in
    driverd reaches into it (so nothing registers itself on import), and no runtime module imports it."""
    tree = ast.parse((PKG / "runtime/registry.py").read_text())
    (table,) = [n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "REGISTRY"]
    built = [c.func.id for c in ast.walk(table.value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    from driverd.runtime.registry import REGISTRY
    assert built == [type(r).__name__ for r in REGISTRY.values()]
    reach = [str(p.relative_to(REPO)) for p in PKG.rglob("*.py") if p != PKG / "runtime/registry.py"
             and re.search(r"registry\.REGISTRY\b|from driverd\.runtime\.registry import [^\n]*\bREGISTRY\b",
                           p.read_text())]
    assert not reach, reach
    for name, rt in REGISTRY.items():
        src = (PKG / "runtime" / f"{type(rt).__module__.rsplit('.', 1)[-1]}.py").read_text()
        assert "registry" not in src, name


def test_distro_families_are_explicit():
    """One table in distro/__init__.py built from the family classes; nobody else assigns it."""
    tree = ast.parse((PKG / "distro/__init__.py").read_text())
    (table,) = [n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "FAMILIES"]
    built = [c.func.id for c in ast.walk(table.value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    from driverd import distro
    assert built == [type(f).__name__ for f in distro.FAMILIES]
    reach = [str(p.relative_to(REPO)) for p in PKG.rglob("*.py") if p != PKG / "distro/__init__.py"
             and re.search(r"\bFAMILIES\s*(=|\+=|\.append)", p.read_text())]
    assert not reach, reach


# The low seams (docs/architecture.md, "Layers"): what each may import, function-level imports included.
LOW_SEAMS = {
    "driverd.runtime": ("driverd.runtime", "driverd.root", "driverd.runner", "driverd.errors", "driverd.fsutil",
                        "driverd.redact", "driverd.log"),
    "driverd.distro": ("driverd.distro", "driverd.root"),
}


def test_runtime_and_distro_import_only_below_them():
    trees = _modules()
    bad = []
    for m, tree in trees.items():
        for seam, allowed in LOW_SEAMS.items():
            if m == seam or m.startswith(seam + "."):
                bad += [f"{m} -> {n}" for n in sorted(_imports(tree, set(trees)))
                        if not any(n == a or n.startswith(a + ".") for a in allowed)]
    assert not bad, bad


def test_readme_points_inside_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme
    assert "docs/architecture.md" in readme and (REPO / "docs/architecture.md").is_file()


def test_sign_file_is_looked_up_inside_the_root_only(tmp_path):
    import os
    from driverd.packages.sign import find_sign_file, signing_pair
    from driverd.root import Root
    root = tmp_path / "host"
    (root / "usr/src").mkdir(parents=True)
    assert find_sign_file(None, Root(root)) is None          # this machine's /usr/src is not looked at
    sf = root / "usr/lib/linux-kbuild-6.1/scripts/sign-file"
    sf.parent.mkdir(parents=True)
    sf.write_text("#!/bin/sh\n")
    os.chmod(sf, 0o755)
    assert find_sign_file(None, Root(root)) == str(sf)
    cfg = {"signing.key": "/k", "signing.cert": "/c"}
    assert signing_pair(cfg) == ("/k", "/c")
    assert signing_pair(cfg, key="/mine") == ("/mine", None)   # never a key from here with a cert from there
