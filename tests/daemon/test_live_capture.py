"""`driverd daemon` on the layout of a real GPU host (captured from the device's H200: Ubuntu 24.04,
kernel 6.18 with signatures enforced and no module unloading, open 580.159.04 loaded as nvidia +
nvidia_uvm only, no /lib/modules, no package record), through the real kernel boundary: it is
converged as it is — READY, /readyz 200, nothing written to the host's configuration, exit 0 on
SIGTERM. Before this round the daemon failed validation (nvidia_modeset) and retried for ever."""
from __future__ import annotations

import hashlib
import re
from tests.daemon.conftest import write_config


def _etc(root) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted((root / "etc").rglob("*"))}


def test_daemon_converges_on_the_captured_h200_host(unpack_host, daemons, tmp_path):
    root = unpack_host("h200-ubuntu-fc-580-open.tar.gz")
    write_config(root, "580.159.04", tmp_path / "no-repo")      # the version that runs; auto flavour
    (root / "etc/driverd/config.toml").write_text((root / "etc/driverd/config.toml").read_text()
                                                  .replace('flavor = "open"', 'flavor = "auto"'))
    before = _etc(root)
    d = daemons(root, env={"DRIVERD_MODULES_KERNEL": "real"})
    _, msg = d.wait_notify("READY=1", 60)
    assert "converged" in msg and "nvidia, nvidia_uvm" in msg, msg
    code, body = d.get("/readyz")
    assert code == 200, body
    d.wait_log(re.escape("left to the host (owner unknown)"), 30)    # the log reader may lag READY=1
    assert "rolls back" not in d.log and "validation failed" not in d.log
    rc, _ = d.stop()
    assert rc == 0
    assert _etc(root) == before              # no blacklist, no module options written
    assert not (root / "etc/modprobe.d").exists()
