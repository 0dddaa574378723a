"""The shape docs/architecture.md promises: no import cycles between driverd's modules, production
code never imports driverd.sim (only the CLI's composition root does), no test hooks in production,
an explicit step registry, and a README that sends readers nowhere outside the repository."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.conftest import REPO

PKG = REPO / "driverd"
COMPOSITION_ROOT = {"driverd/cli/context.py", "driverd/cli/lifecycle_cmds.py", "driverd/cli/host_cmds.py",
                    "driverd/cli/demo.py"}

# docs/architecture.md's layer order, bottom first: a module may import its own package and any
# layer below its own, never a layer above it or a neighbour in its own layer.
LAYERS = [
    {"datatypes"},
    {"data", "redact"}, {"errors"},
    {"backends", "fsutil", "log", "modinfo", "nvproc", "observe", "runner", "safetar"},
    {"root"},
    {"package"},
    {"driver"},
    {"distro", "runtime"},
    {"config"},
    {"host"},
    {"kmod", "plan"},
    {"repo"},
    {"build"},
    {"install"},
    {"apply"},
    {"cluster"},
    {"daemon"},
    {"sim"},
    {"cli"},
    {"__main__"},
]


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


def _unit(module: str) -> str:
    """The layer unit of a module: its subpackage (driverd.apply.steps.modules -> apply) or its own name
    (driverd.errors -> errors)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "driverd"


def _every_import(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, imported driverd module) for every import statement, inside functions too."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "driverd":
            out += [(node.lineno, f"driverd.{a.name}") for a in node.names] if node.module == "driverd" \
                else [(node.lineno, node.module)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "driverd"]
    return out


def _climbs(trees: dict[str, ast.Module]) -> list[str]:
    rank = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    out = []
    for mod, tree in trees.items():
        src = _unit(mod)
        if src == "driverd":
            continue
        for line, target in _every_import(tree):
            dst = _unit(target) if _unit(target) in rank else "driverd"
            if dst in ("driverd", src):     # the package itself (its version string); a sibling module
                continue
            if rank[dst] >= rank[src]:
                out.append(f"{mod}:{line} ({src}) imports {target} ({dst})")
    return out


def test_every_import_goes_down_the_layers():
    trees = _modules()
    units = {_unit(m) for m in trees} - {"driverd"}
    placed = {u for layer in LAYERS for u in layer}
    assert units <= placed, f"place {sorted(units - placed)} in LAYERS (and docs/architecture.md)"
    climbs = _climbs(trees)
    assert not climbs, "\n".join(climbs)


def test_the_layer_check_sees_climbs_inside_functions_and_between_neighbours():
    tree = ast.parse("import driverd.errors\ndef f():\n    from driverd.daemon import loop\n")
    assert _every_import(tree) == [(1, "driverd.errors"), (3, "driverd.daemon")]
    trees = {"driverd.apply.x": tree, "driverd.kmod.y": ast.parse("from driverd.plan.model import Plan"),
             "driverd.cli.z": ast.parse("from driverd import __version__\nfrom driverd.cli import output")}
    assert _climbs(trees) == ["driverd.apply.x:3 (apply) imports driverd.daemon (daemon)",
                              "driverd.kmod.y:1 (kmod) imports driverd.plan.model (plan)"]


def test_architecture_doc_lists_the_layers():
    doc = (REPO / "docs/architecture.md").read_text()
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    order = [u for layer in LAYERS for u in sorted(layer)]
    found = [u for u in order if f"`{u}`" in section]
    assert found == order, f"docs/architecture.md's Layers section lacks {sorted(set(order) - set(found))}"
    positions = [section.index(f"`{u}`") for layer in LAYERS for u in sorted(layer)[:1]]
    assert positions == sorted(positions), "docs/architecture.md lists the layers in another order"


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
    """One table in apply/steps/__init__.py, built from the step classes its modules declare; no step
    module touches it (so nothing registers itself on import)."""
    import importlib
    import pkgutil

    import driverd.apply.steps as steps
    from driverd.apply.step import StepImpl
    from driverd.apply.steps import REGISTRY
    declared = {c.action for info in pkgutil.iter_modules(steps.__path__)
                for c in vars(importlib.import_module(f"{steps.__name__}.{info.name}")).values()
                if isinstance(c, type) and issubclass(c, StepImpl) and c.action and not c.__name__.startswith("_")}
    assert declared == set(REGISTRY), declared ^ set(REGISTRY)
    tree = ast.parse((PKG / "apply/steps/__init__.py").read_text())
    (table,) = [n for n in tree.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "REGISTRY"]
    built = [c.func.id for c in ast.walk(table.value) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    assert sorted(built) == sorted(type(r).__name__ for r in REGISTRY.values())
    registering = [p.name for p in (PKG / "apply/steps").glob("*.py") if p.name != "__init__.py"
                   and "REGISTRY" in p.read_text()]
    assert not registering, registering
    from driverd.plan.actions import ACTIONS
    assert set(ACTIONS) == set(REGISTRY), set(ACTIONS) ^ set(REGISTRY)     # one implementation per action


def _step_reaches(rel: str, tree: ast.Module) -> list[str]:
    """Where a module outside driverd/apply/ imports driverd.apply.steps (or a module of it), and where
    code outside driverd/apply/steps/ runs a step's do() through the registry (REGISTRY[...].do(...))."""
    out = []
    outside_apply = not rel.startswith("driverd/apply/")
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        if outside_apply and any(n == "driverd.apply.steps" or n.startswith("driverd.apply.steps.") for n in names):
            out.append(f"{rel}:{node.lineno} imports driverd.apply.steps")
        if (not rel.startswith("driverd/apply/steps/") and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == "do"
                and isinstance(node.func.value, ast.Subscript)
                and getattr(node.func.value.value, "id", getattr(node.func.value.value, "attr", None)) == "REGISTRY"):
            out.append(f"{rel}:{node.lineno} calls a step's do() through REGISTRY")
    return out


def test_only_apply_reaches_into_the_steps():
    """The steps are the transaction's: the layers above apply read the driver through driver.state and
    validate through apply/validation.py. Nothing but the executor runs a step: no REGISTRY[...].do() in
    driverd, tests, bench or tools (tests may import the steps they test)."""
    offenders = []
    for base in ("driverd", "tests", "bench", "tools"):
        for p in (REPO / base).rglob("*.py"):
            rel = str(p.relative_to(REPO))
            if rel == "tests/test_architecture.py":
                continue
            try:
                tree = ast.parse(p.read_text(), rel)
            except (SyntaxError, UnicodeDecodeError):      # a fixture that is not Python source
                continue
            offenders += [h for h in _step_reaches(rel, tree) if base == "driverd" or "do()" in h]
    assert not offenders, offenders


def test_the_step_reach_check_sees_imports_and_registry_do_calls():
    tree = ast.parse("from driverd.apply import steps as st\nimport driverd.apply.steps.modules\n"
                     "def f(c):\n    from driverd.apply.steps.common import loaded\n    st.REGISTRY['validate'].do(c, {})\n"
                     "    REGISTRY[k].do(c, {})\n")
    assert _step_reaches("driverd/daemon/x.py", tree) == [
        "driverd/daemon/x.py:1 imports driverd.apply.steps", "driverd/daemon/x.py:2 imports driverd.apply.steps",
        "driverd/daemon/x.py:4 imports driverd.apply.steps", "driverd/daemon/x.py:5 calls a step's do() through REGISTRY",
        "driverd/daemon/x.py:6 calls a step's do() through REGISTRY"]
    assert _step_reaches("driverd/apply/reconcile.py", tree) == [
        "driverd/apply/reconcile.py:5 calls a step's do() through REGISTRY",
        "driverd/apply/reconcile.py:6 calls a step's do() through REGISTRY"]
    assert _step_reaches("driverd/apply/steps/x.py", tree) == []


def test_step_lists_name_only_known_actions():
    """plan/steplists.py owns every command's step list; each names actions the executor runs."""
    from types import SimpleNamespace

    from driverd.plan import steplists as sl
    from driverd.plan.actions import ACTIONS
    want = SimpleNamespace(driver="550.1", flavor="open", kernel_release="6.1.0-9-amd64", arch="x86_64")
    lists = [sl.load_steps(), sl.unload_steps("terminate"), sl.reload_steps("/p.tar", ["550.1", "open"]),
             sl.rollback_steps("ab" * 32), sl.rollback_install_steps("ab" * 32, "6.1.0-9-amd64"),
             sl.install_steps("/p.tar", None, None),
             sl.runtime_steps("configure", ["containerd"], {}), sl.runtime_steps("revert", ["docker"], {})]
    for steps in lists:
        assert steps and {s["action"] for s in steps} <= set(ACTIONS), steps
        # a list that changes the running driver or its package records the host first
        assert (steps[0]["action"] == "snapshot") == any(ACTIONS[s["action"]].touches for s in steps), steps
    # ... except the package for another kernel, which leaves the running one alone
    other = sl.prepare_kernel_steps(want, True)
    assert [s["action"] for s in other] == ["fetch-package", "verify-package", "install-package"]
    assert other[-1]["params"]["kernel_release"] == want.kernel_release
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
        src = Path(sys.modules[type(rt).__module__].__file__).read_text()
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
def test_readme_points_inside_the_repository():
    readme = (REPO / "README.md").read_text()
    assert "../shared" not in readme
    assert "docs/architecture.md" in readme and (REPO / "docs/architecture.md").is_file()


def test_sign_file_is_looked_up_inside_the_root_only(tmp_path):
    import os
    from driverd.build.sign import find_sign_file, signing_pair
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


def _is_dataclass_decorator(d: ast.expr) -> bool:
    f = d.func if isinstance(d, ast.Call) else d
    return (isinstance(f, ast.Name) and f.id == "dataclass") or (isinstance(f, ast.Attribute) and f.attr == "dataclass")


def test_every_dataclass_has_its_own_docstring():
    """A dataclass without one gets one made at import: dataclasses calls inspect.signature on it (3.12's
    did so for 33 of the 45 classes `detect` imports, 2 ms of its start-up on a 2-core machine; issue 47).
    The docstring also says what one instance stands for."""
    bare = [f"{p.relative_to(REPO)}:{n.lineno} {n.name}" for p in PKG.rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, ast.ClassDef) and any(map(_is_dataclass_decorator, n.decorator_list))
            and ast.get_docstring(n) is None]
    assert not bare, "dataclasses without a docstring: " + ", ".join(bare)
