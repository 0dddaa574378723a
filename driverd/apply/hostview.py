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


def wants_fabricmanager(ctx) -> bool:
    """The host's fabric needs a fabric manager (PCI NVSwitches, or NVLink5 switch trays managed from this
    host: driverd.host.fabric), read once per transaction."""
    got = ctx.memo.get("fabric-fm")
    if got is None:
        import os
        from driverd.host.fabric import read_fabric
        gpus, sw, nics = pci_view(ctx)
        got = ctx.memo["fabric-fm"] = bool(sw) or read_fabric(
            ctx.root, gpus, sw, nics, getattr(ctx.kernel, "arch", None) or os.uname().machine).want(
            "fabricmanager") is not None
    return got
