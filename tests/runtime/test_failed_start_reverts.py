"""A runtime that does not start again with the handler in its configuration is put back as it was,
started again, and the step fails saying why (issue 35). Before: driverd's restart wrote "failed to
start again" into its report and the step succeeded, leaving a node that runs no containers at all.

systemd is played inside the host tree (driverd runs `chroot ROOT systemctl ...` there, as in the
driver container): a busybox `systemctl` whose containerd refuses to start while its configuration
names the nvidia handler — the fault comes from the test's unit, not from driverd."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from driverd.errors import RuntimeConfigError
from driverd.root import Root
from driverd.runtime import Options, configure
from tests.runtime.conftest import fixture_text, make_host

CFG = "/etc/containerd/config.toml"
BIN = "/usr/bin/nvidia-container-runtime"

SYSTEMCTL = r"""#!/bin/sh
# systemd played for one unit: its state and invocation in /run/fake; every call logged
d=/run/fake
echo "$*" >> $d/log
case "$1" in
  is-active) cat $d/state; [ "$(cat $d/state)" = active ] && exit 0; exit 3 ;;
  show) echo "ActiveState=$(cat $d/state)"; echo "InvocationID=$(cat $d/inv)"; exit 0 ;;
  reset-failed) exit 0 ;;
  try-restart|start)
    # try-restart acts on a running unit only, start on any (what systemd does)
    [ "$1" = try-restart ] && [ "$(cat $d/state)" != active ] && exit 0
    echo "inv$(wc -l < $d/log)" > $d/inv
    if grep -q 'runtimes.nvidia' /etc/containerd/config.toml; then echo failed > $d/state; else echo active > $d/state; fi
    exit 0 ;;
esac
exit 1
"""


@pytest.fixture
def host(tmp_path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("chroot needs root")
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed")
    h = make_host(tmp_path / "host", {CFG: fixture_text("v2.toml", str(tmp_path))}, {"/usr/bin/containerd": "1.6.20"})
    (h / "bin").mkdir(exist_ok=True)
    shutil.copy(busybox, h / "bin/busybox")
    for tool in ("sh", "cat", "echo", "grep", "wc"):
        (h / "bin" / tool).symlink_to("busybox")
    ctl = h / "usr/bin/systemctl"
    ctl.write_text(SYSTEMCTL)
    ctl.chmod(0o755)
    run = h / "run/fake"
    run.mkdir(parents=True)
    (run / "state").write_text("active\n")
    (run / "inv").write_text("inv0\n")
    (run / "log").write_text("")
    b = h / BIN.lstrip("/")
    b.write_text("#!/bin/sh\n")
    b.chmod(0o755)
    return h


def test_a_runtime_that_does_not_start_with_the_handler_gets_its_configuration_back(host):
    before = (host / CFG.lstrip("/")).read_bytes()
    with pytest.raises(RuntimeConfigError) as ei:
        configure(Root(str(host)), "containerd", Options(restart="systemd", binary=BIN, wait_timeout_s=5))
    e = ei.value
    assert (host / CFG.lstrip("/")).read_bytes() == before          # the bytes it had before driverd
    assert (host / "run/fake/state").read_text().strip() == "active"  # and it runs again with them
    calls = (host / "run/fake/log").read_text().splitlines()
    assert [c.split()[0] for c in calls if c.split()[0] in ("try-restart", "reset-failed", "start")] == \
        ["try-restart", "reset-failed", "start"], calls
    msg = e.one_line()
    assert "containerd did not start with the 'nvidia' handler in /etc/containerd/config.toml" in msg, msg
    assert "put its previous configuration back" in msg and "failed to start again" in msg, msg
    assert "journalctl -u containerd" in msg, msg
    # nothing recorded as driverd's any more: a later revert has nothing to undo
    from driverd.runtime import state
    assert "containerd" not in state.load(Root(str(host)))["runtimes"]


def test_a_runtime_that_starts_with_the_handler_keeps_it(host):
    """The same played unit with a containerd that accepts the handler: configured, restarted once."""
    ctl = host / "usr/bin/systemctl"
    ctl.write_text(SYSTEMCTL.replace("grep -q 'runtimes.nvidia'", "false"))
    rep = configure(Root(str(host)), "containerd", Options(restart="systemd", binary=BIN, wait_timeout_s=5))
    assert rep.restarted and "runtimes.nvidia" in (host / CFG.lstrip("/")).read_text()
    assert sum(c.startswith("try-restart") for c in (host / "run/fake/log").read_text().splitlines()) == 1
