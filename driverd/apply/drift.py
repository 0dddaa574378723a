"""Module parameters that differ from the configuration while the wanted driver runs.

The plan compares driver versions and flavours; a changed [modules.parameters] with the same driver
loaded is only visible here. The evidence for what a running module was loaded with, best first:
/sys/module/<m>/parameters/<p> (parameters declared readable); for nvidia's registry keys, which the
driver declares with permission 0 and so never shows in sysfs, /proc/driver/nvidia/params
("EnableGpuFirmware: 18" for NVreg_EnableGpuFirmware); else the parameters recorded with the last
converge of this same driver (driverd loaded it with them). A parameter with no evidence at all is
never called different: the daemon must not reload forever over what it cannot see.
"""
from __future__ import annotations

_TRUE = {"y", "1", "true", "on", "yes"}
_FALSE = {"n", "0", "false", "off", "no"}


def same_value(running: str, wanted: str) -> bool:
    """The kernel's rendering of a value against the configured text: bools print Y/N, integers
    print in decimal (the configuration may say 0x10 or 010), strings as they are."""
    a, b = str(running).strip().strip('"'), str(wanted).strip()
    if a == b:
        return True
    la, lb = a.lower(), b.lower()
    if (la in _TRUE and lb in _TRUE) or (la in _FALSE and lb in _FALSE):
        return True
    try:
        return int(a, 0) == int(b, 0)
    except ValueError:
        return False


def parameter_drift(running: dict[str, dict[str, str]], wanted: dict[str, dict[str, str]],
                    recorded: dict[str, dict[str, str]] | None = None) -> list[str]:
    """`module.param: ...` for every parameter of a loaded module whose running value differs from
    the configuration. `running`: loaded module -> the parameters it shows; `recorded`: what the
    last converge of the running driver loaded it with (None: unknown)."""
    out = []
    for mod, params in sorted(wanted.items()):
        have = running.get(mod)
        if have is None:
            continue                      # not loaded: nothing runs with the wrong value
        rec = (recorded or {}).get(mod, {})
        for k, v in sorted(params.items()):
            if k in have:
                if not same_value(have[k], v):
                    out.append(f"{mod}.{k}: running {str(have[k]).strip()!r}, configured {str(v)!r}")
            elif recorded is not None and (k not in rec or not same_value(rec[k], v)):
                out.append(f"{mod}.{k}: loaded with {rec.get(k, '(its default)')!r}, configured {str(v)!r}")
    for mod, params in sorted((recorded or {}).items()):
        if mod not in running:
            continue
        for k, v in sorted(params.items()):
            if k not in wanted.get(mod, {}):
                out.append(f"{mod}.{k}: loaded with {v!r}, no longer configured")
    return out
