"""Simulated hosts with the simulated kernel and fake packages (real ELF modules, real depmod)."""
from __future__ import annotations


import pytest

from driverd.root import Root
from driverd.runner import Runner


@pytest.fixture(scope="session")
def packages(tmp_path_factory):
    from driverd.sim.scenario import make_packages
    return make_packages(tmp_path_factory.mktemp("pkgs"))


@pytest.fixture
def host(tmp_path, packages):
    """A 2-GPU host with NIC, no NVSwitch (its fabric manager: tests/apply/test_fabricmanager.py), no nouveau,
    package `old` installed (not loaded)."""
    from driverd.install.modules import install
    from driverd.sim.scenario import dgx_spec, make_host
    root = tmp_path / "root"
    make_host(root, dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    install(Root(root), packages["old"], Runner())
    return root


def kernel_of(root):
    from driverd.kmod.kernel import select_kernel
    return select_kernel(Root(root), Runner(), "sim")      # asked for: never inferred from the tree
