"""Issue 46: the companions are the third part of the one driver under install/store.py — a companion
package (built by build-companion from an archive in NVIDIA's documented layout, made by the test:
no real archive is reachable here) is unpacked into its versioned tree and switched in through the same
marker, check, previous record and recovery as the modules and the user-space."""
from __future__ import annotations

import json

import pytest

from driverd.build.companion import build_from_archive
from driverd.driver.companions import CompanionPlaces, current, is_installed
from driverd.errors import PackageError
from driverd.install import companion as ci
from driverd.root import Root
from driverd.sim import fabricmanager as fmsim
from tests.packages import companionfake as cf

OLD, NEW = "535.261.03", "550.127.05"


def fm_package(tmp, version: str):
    """A fabric manager companion whose nv-fabricmanager is the version-checking stand-in."""
    arch = cf.archive(tmp / f"a-{version}", "fabricmanager", version,
                      edit=lambda ms: cf.swap(ms, "bin/nv-fabricmanager", data=fmsim.script(version).encode()))
    return build_from_archive(arch, tmp / "out").ref.path


@pytest.fixture(scope="module")
def fms(tmp_path_factory):
    t = tmp_path_factory.mktemp("fm")
    return {v: fm_package(t, v) for v in (OLD, NEW)}


P = CompanionPlaces("fabricmanager")


def test_install_switch_restore_and_the_previous_record(tmp_path, fms):
    root = Root(tmp_path)
    r = ci.install(root, fms[OLD], places=P, driver=OLD)
    assert r.changed and r.driver_version == OLD and current(root, P).version == OLD
    exe = tmp_path / P.bin_dir.lstrip("/") / "nv-fabricmanager"
    assert fmsim.version_of(exe.read_text()) == OLD                          # started from current/bin
    again = ci.install(root, fms[OLD], places=P, driver=OLD)
    assert not again.changed                                                 # idempotent
    r2 = ci.install(root, fms[NEW], places=P, driver=NEW)
    assert r2.replaced == r.sha256 and current(root, P).version == NEW
    assert json.loads((tmp_path / P.previous.lstrip("/")).read_text())["sha256"] == r.sha256
    back = ci.restore(root, r.sha256, places=P)
    assert back.changed and current(root, P).version == OLD and is_installed(root, P, r.sha256)


def test_another_version_or_component_is_refused_and_nothing_is_written(tmp_path, fms):
    with pytest.raises(PackageError) as e:
        ci.install(Root(tmp_path), fms[OLD], places=P, driver=NEW)
    assert f"is the {OLD} fabricmanager, the driver is {NEW}" in e.value.message
    with pytest.raises(PackageError) as e:
        ci.install(Root(tmp_path), fms[OLD], places=CompanionPlaces("imex"))
    assert "is a fabricmanager package, not imex" in e.value.message
    assert not (tmp_path / "var").exists()


def test_an_interrupted_switch_is_finished_by_the_next_call(tmp_path, fms):
    root = Root(tmp_path)
    a = ci.install(root, fms[OLD], places=P)
    b = ci.install(root, fms[NEW], places=P)
    ci.restore(root, a.sha256, places=P)
    # the state a process killed right after the marker leaves: the marker names NEW, current is still OLD
    (tmp_path / P.pending.lstrip("/")).write_text(json.dumps(
        {"target": b.sha256, "replaced": a.sha256, "set_previous": True, "verify": True}))
    notes = ci.recover(root, places=P)
    assert any("finished the interrupted fabricmanager switch to 550.127.05" in n for n in notes), notes
    assert current(root, P).version == NEW and not (tmp_path / P.pending.lstrip("/")).exists()
