"""kill -9 after every durable effect of install() and restore(), then a new process: the host ends
on a complete, resolvable installation of the package asked for, nothing pending, nothing left over,
and every package that was installed is still kept."""
from __future__ import annotations

import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.packages.conftest import REL, copy_tree, pkgop, problems, result

pytestmark = pytest.mark.real


def count_effects(tmp_path, template, *op) -> list[str]:
    root = copy_tree(template, tmp_path / "count")
    trace = tmp_path / "count.trace"
    out = result(pkgop(root, *op, faults={"FAULTS_TRACE": str(trace)}))
    assert out["ok"], out
    labels = trace.read_text().splitlines()
    assert [int(ln.split()[0]) for ln in labels] == list(range(1, len(labels) + 1))
    return labels


def matrix(tmp_path, template, op, labels, after, forks) -> list[str]:
    """For every N: a fresh copy, `op` killed right after its Nth durable effect, then `after(root, n)`
    (which runs the new processes and returns what is wrong). Returns the failures. The first and
    last N also run as fresh interpreters (FAULTS_KILL_AFTER in the environment at start-up); the
    rest in processes forked from a fork server with the same injector (tests/packages/pkgop.py)."""
    def one(n: int) -> list[str]:
        root = copy_tree(template, tmp_path / f"n{n}")
        run = pkgop if n in (1, len(labels)) else forks
        r = run(root, *op, faults={"FAULTS_KILL_AFTER": str(n)})
        if r.returncode != -signal.SIGKILL:
            return [f"N={n} ({labels[n - 1]}): not killed: rc {r.returncode} {r.stdout[-300:]} {r.stderr[-600:]}"]
        bad = [f"N={n} ({labels[n - 1]}): {p}" for p in after(root, n)]
        if not bad:
            shutil.rmtree(root)             # kept only when something is wrong with it
        return bad
    with ThreadPoolExecutor(len(forks.procs)) as ex:
        return [p for ps in ex.map(one, range(1, len(labels) + 1)) for p in ps]


def test_install_crash_matrix(tmp_path, pk, templates, forks):
    """A installed (by an older driverd: not kept yet, so install(B) must keep it first), install(B)
    killed after each effect; then restore(A) in a new process gives A, and install(B) gives B."""
    A, B = pk["A"], pk["B"]
    labels = count_effects(tmp_path, templates["a_unkept"], "install", str(B.path))
    assert any(ln.split()[1] == "exchange" for ln in labels) and any("depmod" in ln for ln in labels), labels
    assert len(labels) >= 40, labels

    def after(root, n):
        out = result(forks(root, "restore", REL, A.sha256))
        if not out["ok"]:
            return [f"restore(A) failed: {out['error']}"]
        bad = [f"after restore(A): {p}" for p in problems(root, A)]
        out = result(forks(root, "install", str(B.path)))
        if not out["ok"]:
            return bad + [f"install(B) failed: {out['error']}"]
        return bad + [f"after install(B): {p}" for p in problems(root, B, kept=(A, B))]
    failures = matrix(tmp_path, templates["a_unkept"], ("install", str(B.path)), labels, after, forks)
    print(f"install crash matrix: {len(labels) - len({f.split(' ')[0] for f in failures})}/{len(labels)}")
    assert not failures, "\n".join(failures[:20])


def test_restore_crash_matrix(tmp_path, pk, templates, forks):
    """B installed (A kept, previous), restore(A) killed after each effect; restore(A) again in a new
    process ends on A with B kept."""
    A, B = pk["A"], pk["B"]
    labels = count_effects(tmp_path, templates["b"], "restore", REL, A.sha256)
    assert any(ln.split()[1] == "exchange" for ln in labels) and any("depmod" in ln for ln in labels), labels

    def after(root, n):
        out = result(forks(root, "restore", REL, A.sha256))
        if not out["ok"]:
            return [f"restore(A) failed: {out['error']}"]
        return problems(root, A, kept=(A, B))
    failures = matrix(tmp_path, templates["b"], ("restore", REL, A.sha256), labels, after, forks)
    print(f"restore crash matrix: {len(labels) - len({f.split(' ')[0] for f in failures})}/{len(labels)}")
    assert not failures, "\n".join(failures[:20])
