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


def _context(root, extra: str = ""):
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[driver]\nversion = "535.261.03"\nflavor = "open"\n[runtime]\nrestart = "none"\n' + extra)
    return lc.make_context(Root(root), Runner(), load(Root(root), environ={}), "sim")


def test_the_snapshot_and_the_drift_see_the_registry_keys_the_kernel_shows_in_procfs(loaded_host):
    # As a real nvidia module shows them: no NVreg_* under /sys/module/nvidia/parameters, every registry
    # key in procfs, strings quoted (empty: nobody set it).
    assert not list((loaded_host / "sys/module/nvidia/parameters").glob("NVreg_*"))
    (loaded_host / "proc/driver/nvidia/params").write_text(
        'ResmanDebugLevel: 4294967295\nEnableGpuFirmware: 18\nRegistryDwords: ""\nTemporaryFilePath: "/var/tmp"\n')
    ctx = _context(loaded_host, '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "18"\n')

    seen = running_parameters(ctx.kernel, ["nvidia"])["nvidia"]
    assert seen["NVreg_EnableGpuFirmware"] == "18" and seen["NVreg_RegistryDwords"] == ""
    # what the snapshot records, and a rollback loads the last-known-good driver with again
    snap = snapshot_parameters(ctx, ["nvidia"])["nvidia"]
    assert snap["NVreg_EnableGpuFirmware"] == "18" and snap["NVreg_TemporaryFilePath"] == "/var/tmp"
    assert "NVreg_RegistryDwords" not in snap          # unset: passed back it would set a literal ""
    assert {k: v for k, v in seen.items() if v not in ("", "(null)")} == snap
    # and the daemon's drift check, on the same evidence: the configured value runs
    assert verdict_for_host(ctx, ctx.config).drift == ()

    ctx = _context(loaded_host, '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "0"\n')
    assert verdict_for_host(ctx, ctx.config).drift == ("nvidia.NVreg_EnableGpuFirmware: running '18', configured '0'",)
