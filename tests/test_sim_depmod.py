"""The simulated kernel's depmod (driverd/sim/depmod.py) against kmod's real depmod on the same module
trees: the same modules.dep content (modulo the order of lines, which depmod takes from readdir), a
valid load order in every line, and the same resolution as the real `modprobe --show-depends`."""
from __future__ import annotations

import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

from driverd.errors import ModuleError
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim import depmod, fakemod
from driverd.sim.depmod import parse_dep_line
from tests.conftest import require_binary

REL = fakemod.DEFAULT_RELEASE
pytestmark = pytest.mark.real


def _tools() -> tuple[str, str]:
    return (require_binary("depmod", "/usr/sbin/depmod", "/sbin/depmod"),
            require_binary("modprobe", "/usr/sbin/modprobe", "/sbin/modprobe"))


def _m(name: str, deps: tuple[str, ...] = (), **kw) -> fakemod.FakeModule:
    """A module exporting `<name>_fn` and importing its dependencies' symbols: depmod's view (symbols)
    and the .modinfo depends= string agree, as modpost writes them."""
    return fakemod.FakeModule(name, exports=(f"{name}_fn",), imports=tuple(f"{d.replace('-', '_')}_fn" for d in deps),
                              depends=deps, **kw)


def _write(base: Path, sub: str, mod: fakemod.FakeModule, compress: str = "") -> Path:
    p = fakemod.write_module(mod, base / sub)
    if compress == "xz":
        p.with_name(p.name + ".xz").write_bytes(lzma.compress(p.read_bytes(), check=lzma.CHECK_CRC32))
    elif compress == "zst":
        import zstandard
        p.with_name(p.name + ".zst").write_bytes(zstandard.ZstdCompressor().compress(p.read_bytes()))
    if compress:
        p.unlink()
    return p


def _mixed_tree(root: Path) -> None:
    """A diamond (a -> b, c; b -> d; c -> d), a chain through compressed files, a hyphenated name, a
    module whose exporter is absent, a module name in updates/ and kernel/ (updates/ wins), and
    modules under build/ and source/ directories (depmod skips them)."""
    base = root / "lib/modules" / REL
    _write(base, "kernel/drivers/gpu", _m("mod_a", ("mod_b", "mod_c")))
    _write(base, "kernel/drivers/gpu", _m("mod_b", ("mod_d",)))
    _write(base, "kernel/drivers/misc", _m("mod_c", ("mod_d",)), "xz")
    _write(base, "kernel/lib", _m("mod_d"), "zst")
    _write(base, "kernel/lib", _m("snd_core_x"))
    _write(base, "extra", _m("snd-pcm-x", ("snd_core_x", "mod_a")))
    _write(base, "extra", _m("orphan", ("gone",)))
    _write(base, "kernel/drivers/dup", _m("dup", ("mod_d",)))
    _write(base, "updates/dkms", _m("dup", ("mod_b",)))
    _write(base, "kernel/y", _m("dup_user", ("dup",)))
    _write(base, "build", _m("in_build"))
    _write(base, "kernel/source", _m("in_source"))


def _nvidia_tree(root: Path) -> None:
    b = fakemod.write_nvidia_build(root / "b")
    d = root / "lib/modules" / REL / "updates/driverd"
    d.mkdir(parents=True)
    for m in b.modules:
        shutil.copy(m, d)
    shutil.rmtree(root / "b")


def _parse(text: str) -> dict[str, list[str]]:
    return dict(x for x in map(parse_dep_line, text.splitlines()) if x)


def _closure(dep: dict[str, list[str]], path: str) -> set[str]:
    return set(dep[path])


def _both(tmp_path: Path, make) -> tuple[Path, dict, dict, str]:
    dm, _ = _tools()
    real, sim = tmp_path / "real", tmp_path / "sim"
    make(real)
    shutil.copytree(real, sim, symlinks=True)
    subprocess.run([dm, "-b", str(real), REL], check=True, capture_output=True, timeout=120)
    ours = "".join(ln + "\n" for ln in depmod.dependency_lines(sim / "lib/modules" / REL))
    theirs = (real / "lib/modules" / REL / "modules.dep").read_text()
    return real, _parse(theirs), _parse(ours), ours


def _assert_same(theirs: dict, ours: dict) -> None:
    assert set(ours) == set(theirs)
    for path, deps in ours.items():
        assert sorted(deps) == sorted(theirs[path]), path
        assert len(set(deps)) == len(deps)
        # every module comes before the modules it depends on (modprobe inserts from the end)
        for i, x in enumerate(deps):
            assert not any(x in _closure(ours, y) for y in deps[i + 1:]), (path, deps)


def test_nvidia_tree_is_identical(tmp_path):
    _, theirs, ours, text = _both(tmp_path, _nvidia_tree)
    _assert_same(theirs, ours)
    assert ours == theirs           # a chain: one valid order, and the same lists
    assert "updates/driverd/nvidia-drm.ko: updates/driverd/nvidia-modeset.ko updates/driverd/nvidia.ko\n" in text


def test_mixed_tree_has_the_same_dependencies(tmp_path):
    real, theirs, ours, _ = _both(tmp_path, _mixed_tree)
    _assert_same(theirs, ours)
    assert "updates/dkms/dup.ko" in ours and "kernel/drivers/dup/dup.ko" not in ours
    assert ours["kernel/y/dup-user.ko"][0] == "updates/dkms/dup.ko"
    assert ours["extra/orphan.ko"] == [] and not any("in_build" in p or "in_source" in p for p in ours)
    assert set(ours["extra/snd-pcm-x.ko"]) == {"kernel/lib/snd-core-x.ko", "kernel/drivers/gpu/mod-a.ko",
                                              "kernel/drivers/gpu/mod-b.ko", "kernel/drivers/misc/mod-c.ko.xz",
                                              "kernel/lib/mod-d.ko.zst"}
    # the resolution modprobe makes from the real index is the one the simulation makes from its own
    _, mp = _tools()
    sim_dep = "".join(f"{p}:{''.join(' ' + d for d in ds)}\n" for p, ds in ours.items())
    base = real / "lib/modules" / REL
    for name in ("mod_a", "snd-pcm-x", "dup_user", "orphan", "mod_d"):
        out = subprocess.run([mp, "-d", str(real), "-S", REL, "--show-depends", name], capture_output=True,
                             text=True, check=True).stdout
        files = [ln.split()[1] for ln in out.splitlines() if ln.startswith("insmod ")]
        mine = [str(base / p) for p in depmod.show_depends(base, sim_dep, name)]
        assert sorted(mine) == sorted(files) and mine[-1] == files[-1], name
        assert depmod.show_depends(base, (base / "modules.dep").read_text(), name) is not None


def test_simulated_kernel_indexes_and_resolves_without_kmod_tools(tmp_path):
    """The kernel boundary on a simulated host: depmod writes modules.dep (no subprocess runs), a
    stale binary index of a real depmod is dropped, show_depends resolves, an absent module is the
    FATAL modprobe prints."""
    from driverd.kmod.kernel import select_kernel
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "host"
    make_host(root, dgx_spec(gpus=1, nvswitches=0, nouveau=False))
    _nvidia_tree(root)
    (root / "lib/modules" / REL / "modules.dep.bin").write_bytes(b"stale")
    runner = Runner()
    k = select_kernel(Root(root), runner, "sim")          # asked for: never inferred from the tree
    assert k.name == "sim"
    assert k.depmod(REL).startswith("depmod -b ") and not runner.history
    assert not (root / "lib/modules" / REL / "modules.dep.bin").exists()
    files = k.show_depends(REL, "nvidia-drm")
    assert [Path(f).name for f in files] == ["nvidia.ko", "nvidia-modeset.ko", "nvidia-drm.ko"]
    assert all(Path(f).is_file() for f in files)
    with pytest.raises(ModuleError, match="Module nouveau not found"):
        k.show_depends(REL, "nouveau")
    (root / "lib/modules" / REL / "updates/driverd/nvidia.ko").write_bytes(b"\x7fELF junk")
    with pytest.raises(ModuleError, match="depmod failed"):
        k.depmod(REL)
    assert k.depmod(REL, check=False)           # unchecked (switching back): reported, not raised
