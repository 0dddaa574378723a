"""The real kernel's log position survives a full ring buffer: marks are timestamps, not line counts
(found on Debian's 6.1 in the VM tests: after a verbose boot the buffer is full, old lines drop out
as new ones arrive, and a count hid exactly the lines of the failed load)."""
from __future__ import annotations

from dataclasses import dataclass

from driverd.kmod.kernel import RealKernel, _stamped
from driverd.root import Root


@dataclass
class _Res:
    stdout: str
    ok: bool = True


class _Ring:
    """A runner whose `dmesg` is a fixed-size ring buffer."""
    dry_run = False

    def __init__(self, size: int) -> None:
        self.size, self.lines, self.t = size, [], 0

    def log(self, text: str) -> None:
        self.t += 1
        self.lines = (self.lines + [f"[{self.t:5d}.000000] {text}"])[-self.size:]

    def run(self, argv, **kw):
        return _Res("\n".join(self.lines) + "\n")


def test_lines_since_a_mark_when_the_ring_buffer_is_full(monkeypatch):
    from driverd.kmod import kmsg
    monkeypatch.setattr(kmsg, "records", lambda: None)      # /dev/kmsg unreadable: dmesg's output is read
    ring = _Ring(5)
    for i in range(10):
        ring.log(f"boot {i}")
    k = RealKernel(Root("/"), ring)
    monkeypatch.setattr(k, "live", True)
    mark = k.log_mark()
    ring.log("NVRM: GPU 0000:18:00.0: RmInitAdapter failed!")
    ring.log("NVRM: None of the NVIDIA devices were initialized.")
    assert len(ring.lines) == 5                      # the buffer is full: a count would say "nothing new"
    assert k.log_since(mark) == ring.lines[-2:]


def test_continuation_lines_take_the_stamp_before_them():
    assert _stamped(["[    1.500000] a", "  continued", "[    2.000001] b"]) == \
        [(1_500_000, "[    1.500000] a"), (1_500_000, "  continued"), (2_000_001, "[    2.000001] b")]


def test_a_zombie_holder_is_gone():
    """A terminated process its parent has not reaped yet holds nothing: not alive for the unload."""
    import subprocess
    import time
    from driverd.runner import Runner
    p = subprocess.Popen(["sleep", "30"])
    k = RealKernel(Root("/"), Runner())
    assert k.alive(p.pid)
    p.terminate()
    deadline = time.monotonic() + 10
    while k.alive(p.pid) and time.monotonic() < deadline:     # a zombie until p.wait() below
        time.sleep(0.05)
    assert not k.alive(p.pid)
    assert p.poll() is not None or p.wait(5) is not None
