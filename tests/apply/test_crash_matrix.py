"""kill -9 right after every durable effect inside a command (each rename, fsync'd write, unlink,
directory switch, module load/unload, daemon start/stop, external command), then the next driverd
command: the host ends with the new driver validated or the last-known-good driver loaded with its
files intact, and the journal says which. The faults come from the test side
(tests/faults/sitecustomize.py on the child's PYTHONPATH), never from hooks in driverd."""
from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.apply.conftest import drv, journal, kernel_of

OLD, NEW = ("535.261.03", "open"), ("550.127.05", "open")


def final(root) -> tuple:
    from driverd.kmod.daemons import select_services
    from driverd.driver.state import installed_modules
    from driverd.kmod.load import validate
    k = kernel_of(root)
    v = validate(k, None, None, select_services(k), True)
    got = installed_modules(k.root, k.release)
    inst = None if got is None else (got.driver.version, got.driver.flavor, got.package_sha256)
    return (v.version, v.flavor), v, inst, journal(root)


def pending_markers(root) -> list[str]:
    d = Path(root) / "var/lib/driverd/packages"
    return sorted(p.name for p in d.glob("pending-*")) if d.is_dir() else []


def us_in_use(root) -> tuple[str | None, bool]:
    """(version of driverd's user-space in use, a user-space switch pending)."""
    from driverd.install import userspace as ui
    from driverd.driver import userspace as dus
    from driverd.root import Root
    cur = dus.current(Root(root), ui.Places())
    return (cur.version if cur and cur.intact else None), (Path(root) / "var/lib/driverd/userspace/pending.json").exists()


@pytest.fixture(scope="module")
def us_packages(tmp_path_factory):
    """User-space packages (tests/packages/usfake: real ELF objects, the cudastandin libraries) of both versions
    and of the broken package's version; the crash matrix validates without the workload check."""
    from driverd.build.userspace import build_from_run_dir
    from tests.conftest import require_binary
    from tests.packages import usfake
    require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    t = tmp_path_factory.mktemp("us")
    return {f"us-{k}": build_from_run_dir(usfake.run_dir(t / f"src-{k}", v), t / "out").ref.path
            for k, v in (("old", OLD[0]), ("new", NEW[0]), ("broken", "550.127.08"))}


def fm_in_use(root) -> tuple[str | None, bool]:
    """(version of driverd's fabric manager companion in use, a companion switch pending)."""
    from driverd.driver.companions import CompanionPlaces, current
    from driverd.root import Root
    p = CompanionPlaces("fabricmanager")
    cur = current(Root(root), p)
    return (cur.version if cur and cur.intact else None), (Path(root) / p.pending.lstrip("/")).exists()


@pytest.fixture(scope="module")
def fm_packages(tmp_path_factory):
    """Fabric manager companion packages of both versions (issue 46), built by build-companion from archives in
    NVIDIA's layout made by tests/packages/companionfake.py; nv-fabricmanager is the version-checking stand-in."""
    from driverd.build.companion import build_from_archive
    from driverd.sim import fabricmanager as fmsim
    from tests.packages import companionfake as cf
    t = tmp_path_factory.mktemp("fm")
    out = {}
    for key, v in (("fm-old", OLD[0]), ("fm-new", NEW[0])):
        arch = cf.archive(t / key, "fabricmanager", v,
                          edit=lambda ms, v=v: cf.swap(ms, "bin/nv-fabricmanager", data=fmsim.script(v).encode()))
        out[key] = build_from_archive(arch, t / "out").ref.path
    return out


def _host(base: Path, kind: str, packages) -> Path:
    from driverd.install.modules import install
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.scenario import dgx_spec, make_host
    root = make_host(base, dgx_spec(gpus=2, nvswitches=1 if kind == "loaded-fm" else 0, nouveau=(kind == "fresh")))
    if kind == "fresh":
        cfg = root / "etc/driverd/config.toml"
        cfg.parent.mkdir(parents=True, exist_ok=True)
        cfg.write_text(f'[driver]\nversion = "{OLD[0]}"\nflavor = "open"\n[packages]\nrepositories = '
                       f'["file://{packages["old"].parent}"]\n[runtime]\nrestart = "none"\n')
        return root
    install(Root(root), packages["old"], Runner())
    if kind == "loaded-us":
        from driverd.install import userspace as ui
        (root / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
        (root / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
        ui.install(Root(root), packages["us-old"], Runner())
    if kind == "loaded-fm":           # both companions installed, 535's in use: a reload switches to 550's tree
        from driverd.driver.companions import CompanionPlaces
        from driverd.install import companion as ci
        p = CompanionPlaces("fabricmanager")
        ci.install(Root(root), packages["fm-new"], places=p)
        ci.install(Root(root), packages["fm-old"], places=p)
    r = drv(root, "load")
    assert r.returncode == 0, r.stderr
    return root


def kill_points(labels: list[str]) -> list[int]:
    """`labels`: the trace's lines ("N op path..."). The kill points (N) whose state differs from the one before: a kill -9 ends the process, not
    the machine, so an fsync of a directory right after an effect in it (a rename, replace, link or mkdir
    there; the fsync of a file there) or the same fsync again leaves exactly the files the kill before it
    left. A kill there is the previous trial again (a quarter of the points; issue 41: the matrix was the
    suite's longest CPU work). An fsync of a file stays: a file written since the last effect (not an
    effect itself) is on disk only from there on."""
    out = []
    for n, label in enumerate(labels, 1):
        _, op, *paths = label.split(" ")
        if op == "fsync" and n > 1:
            _, before_op, *before = labels[n - 2].split(" ")
            if any(os.path.dirname(p) == paths[0] for p in before) or (before_op == "fsync" and before == paths):
                continue
        out.append(n)
    return out


def test_kill_points_skip_only_what_leaves_the_same_files():
    labels = [f"{n} {label}" for n, label in enumerate((
        "fsync /r/d/.j.tmp", "replace /r/d/.j.tmp /r/d/j.json", "fsync /r/d", "fsync /r/d", "mkdir /r/d/stage",
        "fsync /r/d/stage/a.ko", "fsync /r/d/stage", "fsync /r/e", "kernel load nvidia", "fsync /r/d/.k.tmp"), 1)]
    # the directory fsyncs after an effect in it, and the same fsync again, go; a file's fsync stays
    # (the file may have been written since), so does an fsync of another directory
    assert kill_points(labels) == [1, 2, 5, 6, 8, 9, 10]


SCENARIOS = {
    # name: (host kind, command, what a run that is not interrupted ends with)
    "apply-fresh-host": ("fresh", ("apply",), (OLD, "done")),
    "reload-535-to-550": ("loaded", ("reload", "--package", "new"), (NEW, "done")),
    "failing-reload": ("loaded", ("reload", "--package", "broken"), (OLD, "rolled-back")),
    # issue 31: the user-space switched in the same transaction (install-userspace; restore-userspace on the way back)
    "reload-with-userspace": ("loaded-us", ("reload", "--package", "new", "--userspace", "us-new"), (NEW, "done")),
    "failing-reload-with-userspace": ("loaded-us", ("reload", "--package", "broken", "--userspace", "us-broken"),
                                      (OLD, "rolled-back")),
    # issue 46: the fabric manager's companion tree switched with the modules (install-companion)
    "reload-with-fabricmanager": ("loaded-fm", ("reload", "--package", "new"), (NEW, "done")),
}


@pytest.mark.slow
@pytest.mark.timeout(1800)      # dozens of kill points, each a driverd run and a recovery: minutes on a loaded CI machine
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kill9_after_every_durable_effect(tmp_path, packages, name, request):
    kind, cmd, (want, want_state) = SCENARIOS[name]
    if kind == "loaded-us":
        if __import__("os").geteuid() != 0:
            from tests.conftest import missing_component
            missing_component("ldconfig -r ROOT chroots: the user-space crash matrix runs as root (CI does)")
        packages = {**packages, **request.getfixturevalue("us_packages")}
    if kind == "loaded-fm":
        packages = {**packages, **request.getfixturevalue("fm_packages")}
    args = tuple(str(packages[a]) if a in packages else a for a in cmd)
    template = _host(tmp_path / "template", kind, packages)
    count = tmp_path / "count"
    shutil.copytree(template, count, symlinks=True)
    trace = tmp_path / "trace"
    r = drv(count, *args, faults={"FAULTS_TRACE": trace, "FAULTS_UNDER": count})
    assert r.returncode in (0, 3), r.stderr
    labels = trace.read_text().splitlines()
    assert final(count)[0] == want and journal(count)["state"] == want_state
    if kind == "loaded-us":
        assert us_in_use(count) == (want[0], False)
    if kind == "loaded-fm":
        assert fm_in_use(count) == (want[0], False)
        assert any("install-companion" in s["action"] for s in journal(count)["steps"])
    assert len(labels) >= 20, labels

    def trial(n: int) -> tuple[int, str, str]:
        root = tmp_path / f"n{n}"
        shutil.copytree(template, root, symlinks=True)
        killed = drv(root, *args, faults={"FAULTS_KILL_AFTER": n, "FAULTS_UNDER": root})
        assert killed.returncode == -signal.SIGKILL, (n, labels[n - 1], killed.returncode, killed.stderr[-600:])
        again = drv(root, *args)                                     # the next driverd command
        loaded, v, inst, doc = final(root)
        where = (n, labels[n - 1], again.returncode, again.stderr[-800:])
        assert v.ok, (where, v.problems)
        assert loaded in (want, OLD), (where, loaded)
        # The journal says which: the wanted driver after a finished run, the last-known-good one after a rollback.
        assert doc["state"] == ("done" if loaded == want and want_state == "done" else "rolled-back"), (where, doc["state"])
        assert inst is not None and (inst[0], inst[1]) == loaded, (where, inst)
        assert not pending_markers(root), (where, pending_markers(root))
        if kind == "loaded-us":       # both halves of one driver: the user-space in use is the loaded version's
            assert us_in_use(root) == (loaded[0], False), (where, us_in_use(root))
        if kind == "loaded-fm":       # and its fabric manager
            assert fm_in_use(root) == (loaded[0], False), (where, fm_in_use(root))
        shutil.rmtree(root)
        return n, labels[n - 1], doc["state"]

    points = kill_points(labels)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(trial, points))
    ends = {s: sum(1 for r in results if r[2] == s) for s in ("done", "rolled-back")}
    print(f"\ncrash matrix {name}: {len(results)} kill points of {len(labels)} effects end validated (the others "
          f"leave the files of the one before) ({ends['done']} done on the new driver, {ends['rolled-back']} rolled "
          f"back to the last-known-good)")
    assert len(results) == len(points) >= len(labels) * 2 // 3
