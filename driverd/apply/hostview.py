"""What a transaction reads of the host beside the driver itself (driverd.driver.state reads that): the
PCI devices, once per transaction, and this boot's id. Used by the steps, the validation and the layers
above apply (the cluster's node host), which must not reach into the steps."""
from __future__ import annotations


def pci_view(ctx) -> tuple:
    """(GPUs, NVSwitches, NICs) on the PCI bus, read once per transaction (StepContext.memo): the steps'
    decisions of one transaction see the same devices (a reload read them five times). The validation
    reads the bus again: it proves the driver on the host as it is."""
    got = ctx.memo.get("pci")
    if got is None:
        from driverd.host import pci
        got = ctx.memo["pci"] = pci.classify(ctx.root, pci.scan(ctx.root, []), [])
    return got


def boot_id(ctx) -> str | None:
    """This boot's id: a reboot requirement recorded under another one has been met."""
    return ctx.root.read_first_line("/proc/sys/kernel/random/boot_id") or None


def fabric(ctx):
    """The host's fabric (driverd.host.fabric: its kind, what it wants, the DRA driver's ComputeDomains), read
    once per transaction."""
    got = ctx.memo.get("fabric")
    if got is None:
        import os
        from driverd.host.fabric import read_fabric
        gpus, sw, nics = pci_view(ctx)
        # the host's arch as the facts read it (under a root: the tree's), else this machine's
        arch = ctx.root.read_first_line("/proc/sys/kernel/arch") or os.uname().machine
        got = ctx.memo["fabric"] = read_fabric(ctx.root, gpus, sw, nics, arch)
    return got


def fabric_daemons(ctx, cfg=None):
    """driverd.plan.companions' decision for this host under `cfg` (default the context's): which companion
    daemons driverd runs, who owns IMEX."""
    from driverd.plan.companions import decide
    cfg = cfg if cfg is not None else ctx.config
    return decide(fabric(ctx), len(pci_view(ctx)[1]), cfg["daemons.fabricmanager"], cfg["daemons.imex"])


def wanted_daemons(ctx, cfg=None) -> list[str]:
    """The GPU daemons driverd keeps running on this host, in the order they start."""
    cfg = cfg if cfg is not None else ctx.config
    return fabric_daemons(ctx, cfg).wanted(cfg["daemons.persistenced"])


def known_daemons(ctx) -> list[str]:
    """Every GPU daemon of driverd's (what a stop before the unload stops, what a snapshot records): not the
    IMEX daemons of the DRA driver's ComputeDomains, which are their pods'."""
    return fabric_daemons(ctx).known()
