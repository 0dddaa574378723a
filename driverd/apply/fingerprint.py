"""What the host was last converged to, kept in <state.dir>/daemon/converged.json: a fingerprint of
the configuration that decides the host's state, the kernel release and the installed package's
sha256, with the driver that was loaded and validated, the module parameters it was loaded with and
every driver setting of that converge (config.DRIVER_SETTINGS: what a cluster-mode node keeps until a
rollout changes it).
The container entrypoint compares it on start: same fingerprint, same driver loaded and valid ->
ready at once, nothing reloaded."""
from __future__ import annotations

import hashlib
import json
import time

RECORD = "daemon/converged.json"          # under state.dir

# The keys that decide what the host should look like (where packages come from, cache sizes,
# timers and the like do not).
DESIRED_KEYS = ("driver.version", "driver.flavor", "driver.manage", "modules.parameters", "modules.load_drm",
                "modules.load_peermem", "signing.key", "signing.cert", "runtime.runtimes", "runtime.handler", "runtime.binary",
                "runtime.set_as_default", "runtime.cdi", "daemons.persistenced", "daemons.fabricmanager",
                "daemons.mode")


def fingerprint(cfg, kernel_release: str | None, package_sha256: str | None) -> str:
    doc = {"config": {k: cfg[k] for k in DESIRED_KEYS}, "kernel": kernel_release, "package": package_sha256}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _path(cfg) -> str:
    return f"{cfg['state.dir'].rstrip('/')}/{RECORD}"


def read(root, cfg) -> dict | None:
    text = root.read_text(_path(cfg))
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def recorded_parameters(rec: dict | None, loaded: dict | None, kernel_release: str | None) -> dict | None:
    """The module parameters the running driver was loaded with, when the record is about it."""
    if not rec or not loaded or rec.get("driver") != loaded or rec.get("kernel") != kernel_release:
        return None
    params = rec.get("parameters")
    return params if isinstance(params, dict) else None


def recorded_settings(rec: dict | None) -> dict | None:
    """The driver settings of the last converge (None: not recorded, e.g. by an older driverd)."""
    settings = (rec or {}).get("settings")
    return settings if isinstance(settings, dict) else None


def write(root, cfg, fp: str, loaded: dict | None, package_sha256: str | None, kernel_release: str | None) -> bool:
    """Record a converge; written only when something in it changed (an idle daemon writes nothing)."""
    rec = {"fingerprint": fp, "driver": loaded, "package_sha256": package_sha256, "kernel": kernel_release,
           "parameters": cfg["modules.parameters"], "settings": cfg.driver_settings()}
    old = read(root, cfg)
    if old is not None and {k: old.get(k) for k in rec} == rec:
        return False
    root.atomic_write_json(_path(cfg), {**rec, "at": time.time()}, 0o644)
    return True
