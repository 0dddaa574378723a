"""A reload reads the modules it is about, not every module of the host (issue 34: a GPU host runs a hundred
modules or more, each several sysfs files, and a reload asked a dozen times): `modules(names)` reads only
those, `loaded_names()` only /proc/modules, and the unload order still follows every holder, transitively."""
from __future__ import annotations

from driverd.kmod import load as ld, unload as ul
from driverd.kmod.kernel import LoadedModule, RealKernel
from driverd.root import Root
from driverd.runner import Runner
from tests.kmod.conftest import kernel_of


def _sysfs_modules_read(root: Root) -> set[str]:
    return {p.split("/")[3] for p in root.recorded if p.startswith("/sys/module/") and p.count("/") >= 3}


def test_named_modules_are_the_only_ones_read(host):
    ld.load(kernel_of(host), ["nvidia", "nvidia_uvm", "nvidia_modeset"], {"nvidia": {"NVreg_EnableGpuFirmware": "0"}},
            ("535.261.03", "open"))
    root = Root(host, record=True)
    k = RealKernel(root, Runner())                 # reading a tree is allowed; changing it is not
    every = k.modules()
    assert len(every) > 3 and set(every) == k.loaded_names(), every
    root.recorded.clear()
    got = k.modules(["nvidia", "nvidia_modeset", "nouveau"])           # nouveau is not loaded
    assert set(got) == {"nvidia", "nvidia_modeset"} and got == {n: every[n] for n in got}
    assert got["nvidia"].parameters["NVreg_EnableGpuFirmware"] == "0"
    assert _sysfs_modules_read(root) == {"nvidia", "nvidia_modeset"}
    root.recorded.clear()
    assert "nvidia_uvm" in k.loaded_names() and k.is_loaded("nvidia") and not k.is_loaded("nouveau")
    assert _sysfs_modules_read(root) == set()


class _Table:
    """A kernel of fixed modules: which names were asked for is recorded."""

    def __init__(self, holders: dict[str, tuple[str, ...]]) -> None:
        self.holders, self.asked = holders, []

    def modules(self, names=None):
        names = list(self.holders) if names is None else list(names)
        self.asked += names
        return {n: LoadedModule(n, len(self.holders[n]), self.holders[n]) for n in names if n in self.holders}


def test_the_unload_order_follows_foreign_holders_transitively_reading_nothing_else():
    k = _Table({"nvidia": ("gdrdrv", "nvidia_modeset", "nvidia_uvm"), "nvidia_uvm": (), "nvidia_modeset": ("nvidia_drm",),
                "nvidia_drm": (), "gdrdrv": ("gdr_helper",), "gdr_helper": (), "ext4": (), "mlx5_core": ()})
    mods = ul.with_holders(k, ul.NVIDIA_FAMILY)
    assert set(mods) == {"nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "gdrdrv", "gdr_helper"}
    assert "ext4" not in k.asked and "mlx5_core" not in k.asked
    order = ul.unload_order(mods, set(ul.NVIDIA_FAMILY))
    assert order.index("gdr_helper") < order.index("gdrdrv") < order.index("nvidia")
    assert order.index("nvidia_drm") < order.index("nvidia_modeset") < order.index("nvidia")
    assert order == ul.unload_order(k.modules(), set(ul.NVIDIA_FAMILY))      # the same as from every module
