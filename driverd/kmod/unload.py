"""Unloading the driver: find every holder, refuse with the list unless the policy allows
terminating processes (SIGTERM, grace period, SIGKILL), unload in the order the holder graph gives
(never a fixed list), and verify the modules are gone."""
from __future__ import annotations

import signal
from dataclasses import field

from driverd.datatypes import dataclass
from driverd.errors import ModuleError
from driverd.kmod.holders import NVIDIA_FAMILY, Holders, find_holders


def unload_order(mods: dict, targets: set[str]) -> list[str]:
    """Targets plus every loaded module holding them (transitively), holders before what they hold."""
    want = set(t for t in targets if t in mods)
    changed = True
    while changed:
        changed = False
        for m in list(want):
            for h in mods[m].holders:
                if h in mods and h not in want:
                    want.add(h)
                    changed = True
    order: list[str] = []
    left = set(want)
    while left:
        # A module can go once no remaining module holds it.
        ready = sorted(m for m in left if not any(h in left for h in mods[m].holders))
        if not ready:
            raise ModuleError(f"holder cycle among {', '.join(sorted(left))}", fix="inspect /sys/module/*/holders")
        order.extend(ready)
        left -= set(ready)
    return order


def with_holders(kernel, targets) -> dict:
    """The loaded targets and every module holding them, transitively: all unload_order reads (the
    other modules of the host are not read)."""
    mods = kernel.modules(targets)
    asked = set(targets)
    while True:
        more = {h for m in mods.values() for h in m.holders} - asked
        if not more:
            return mods
        asked |= more
        mods.update(kernel.modules(sorted(more)))


@dataclass
class UnloadReport:
    """What one unload of the driver did: the order the modules went in and the processes it terminated."""
    order: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)
    holders: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def terminate(kernel, holders: Holders, grace: float) -> list[str]:
    pids = [p.pid for p in holders.processes]
    for pid in pids:
        kernel.signal(pid, signal.SIGTERM)
    left = kernel.wait_gone(pids, grace)
    for pid in left:
        kernel.signal(pid, signal.SIGKILL)
    still = kernel.wait_gone(left, 10)
    if still:
        raise ModuleError(f"process(es) {', '.join(map(str, still))} survived SIGKILL",
                          cause="they are stuck in the kernel (D state)", fix="reboot the host")
    return [p.describe() for p in holders.processes]


def unload(kernel, policy: str = "refuse", grace: float = 30.0, targets: tuple[str, ...] = NVIDIA_FAMILY) -> UnloadReport:
    rep = UnloadReport()
    if not set(targets) & kernel.loaded_names():
        return rep
    h = find_holders(kernel)
    rep.holders = h.to_json()
    foreign = [m for m in h.modules if m.foreign]
    if h.blocking and policy != "terminate":
        raise ModuleError("the NVIDIA driver is in use: " + h.describe(),
                          cause="unloading would pull the GPU from under these holders",
                          fix="stop them (drain the node), or set modules.unload_policy=terminate to have driverd "
                              "terminate processes and unload holder modules",
                          details={"holders": h.to_json()})
    if h.processes:
        rep.terminated = terminate(kernel, h, grace)
    if h.unexplained and not h.processes:
        raise ModuleError("the NVIDIA driver is in use: " + h.describe(), cause="references with no visible owner",
                          fix="stop the console/display on the GPU (nvidia_drm fbdev) or reboot",
                          details={"holders": h.to_json()})
    del foreign
    rep.order = unload_order(with_holders(kernel, targets), set(targets))
    for m in rep.order:
        kernel.unload(m)
        rep.unloaded.append(m)
    still = kernel.loaded_names()
    left = [m for m in rep.order if m in still]
    if left:
        raise ModuleError(f"modules still loaded after unload: {', '.join(left)}", fix="check dmesg")
    return rep
