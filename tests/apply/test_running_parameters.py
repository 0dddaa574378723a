"""One reader of the parameters a running driver was loaded with (issue 45): the snapshot a rollback
reloads with and the drift a daemon reloads for read the same values, nvidia's registry keys included
(a real kernel hides them in sysfs, mode 0, and shows them in /proc/driver/nvidia/params)."""
from __future__ import annotations

from driverd.apply import lifecycle as lc
from driverd.apply.steps.common import running_parameters as snapshot_parameters
from driverd.apply.hostplan import verdict_for_host
from driverd.config import load
from driverd.driver.state import running_parameters
from driverd.root import Root
from driverd.runner import Runner


# /proc/driver/nvidia/params of an H200 host running the open 580.159.04 modules (this project's GPU machine,
# 2026-11-29), which has no /sys/module/nvidia/parameters at all: every registry key is declared mode 0.
REAL_PARAMS = """ResmanDebugLevel: 4294967295
RmLogonRC: 1
ModifyDeviceFiles: 1
DeviceFileUID: 0
DeviceFileGID: 0
DeviceFileMode: 438
InitializeSystemMemoryAllocations: 1
UsePageAttributeTable: 4294967295
EnableMSI: 1
EnablePCIeGen3: 0
MemoryPoolSize: 0
KMallocHeapMaxSize: 0
VMallocHeapMaxSize: 0
IgnoreMMIOCheck: 0
EnableStreamMemOPs: 0
EnableUserNUMAManagement: 1
NvLinkDisable: 1
RmProfilingAdminOnly: 0
PreserveVideoMemoryAllocations: 0
EnableS0ixPowerManagement: 0
S0ixPowerManagementVideoMemoryThreshold: 256
DynamicPowerManagement: 3
DynamicPowerManagementVideoMemoryThreshold: 200
RegisterPCIDriver: 1
EnablePCIERelaxedOrderingMode: 0
EnableResizableBar: 0
EnableGpuFirmware: 18
EnableGpuFirmwareLogs: 2
RmNvlinkBandwidthLinkCount: 0
EnableDbgBreakpoint: 0
OpenRmEnableUnsupportedGpus: 1
DmaRemapPeerMmio: 1
ImexChannelCount: 2048
CreateImexChannel0: 0
GrdmaPciTopoCheckOverride: 0
CoherentGPUMemoryMode: ""
RegistryDwords: ""
RegistryDwordsPerDevice: ""
RmMsg: ""
GpuBlacklist: ""
TemporaryFilePath: ""
ExcludedGpus: ""
"""


def _context(root, extra: str = ""):
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n[runtime]\nrestart = "none"\n' + extra)
    return lc.make_context(Root(root), Runner(), load(Root(root), environ={}), "sim")


def test_the_snapshot_and_the_drift_see_the_registry_keys_the_kernel_shows_in_procfs(loaded_host):
    # As a real nvidia module shows them: no NVreg_* under /sys/module/nvidia/parameters, every registry
    # key in procfs, strings quoted (empty: nobody set it).
    assert not list((loaded_host / "sys/module/nvidia/parameters").glob("NVreg_*"))
    (loaded_host / "proc/driver/nvidia/params").write_text(REAL_PARAMS.replace('TemporaryFilePath: ""',
                                                                                'TemporaryFilePath: "/var/tmp"'))
    ctx = _context(loaded_host, '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "18"\n')

    seen = running_parameters(ctx.kernel, ["nvidia"])["nvidia"]
    assert seen["NVreg_EnableGpuFirmware"] == "18" and seen["NVreg_RegistryDwords"] == ""
    # what the snapshot records, and a rollback loads the last-known-good driver with again
    snap = snapshot_parameters(ctx, ["nvidia"])["nvidia"]
    assert snap["NVreg_EnableGpuFirmware"] == "18" and snap["NVreg_TemporaryFilePath"] == "/var/tmp"
    assert snap["NVreg_NvLinkDisable"] == "1" and len(snap) == 36   # what ran is what a rollback loads again
    assert "NVreg_RegistryDwords" not in snap          # unset: passed back it would set a literal ""
    assert {k: v for k, v in seen.items() if v not in ("", "(null)")} == snap
    # and the daemon's drift check, on the same evidence: the configured value runs
    assert verdict_for_host(ctx, ctx.config).drift == ()

    ctx = _context(loaded_host, '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "0"\n')
    assert verdict_for_host(ctx, ctx.config).drift == ("nvidia.NVreg_EnableGpuFirmware: running '18', configured '0'",)
