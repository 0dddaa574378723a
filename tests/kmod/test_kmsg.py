"""The kernel log read from /dev/kmsg in-process (driverd.kmod.kmsg): its records in dmesg's words, the tail
of a load attempt read without starting dmesg, and dmesg where /dev/kmsg cannot be read. The device is
stood in for by a SOCK_SEQPACKET socket, which like /dev/kmsg returns one record per read and EAGAIN at
the end; that the lines equal dmesg's on a real kernel is tests/vm's (reload_cost)."""
from __future__ import annotations

import os
import socket

import pytest

from driverd.errors import ModuleError
from driverd.kmod import kmsg
from driverd.kmod.kernel import RealKernel
from driverd.root import Root

NVRM = b"4,812,5123456789,-;NVRM: driverd stand-in 550.163.01: init failure requested (NVreg_StandinFailInit=1)\n"


def test_a_record_in_dmesgs_words():
    rec = b"6,1234,5678901234,-,caller=T1;nvidia: module license 'NVIDIA' taints kernel \\x5c ok\n" \
          b" SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n"
    assert kmsg.parse_record(rec) == [(5678901234, "[ 5678.901234] nvidia: module license 'NVIDIA' taints kernel \\ ok")]
    assert kmsg.parse_record(b"4,5,1500000,-;line one\\x0aline two\n") == \
        [(1500000, "[    1.500000] line one"), (1500000, "[    1.500000] line two")]
    assert kmsg.parse_record(b"caf\xc3\xa9") == [] and kmsg.parse_record(b"6,1,x,-;y\n") == []
    assert kmsg.parse_record("6,2,3,-;caf\u00e9\n".encode()) == [(3, "[    0.000003] café")]


@pytest.fixture
def device(monkeypatch):
    """/dev/kmsg as a socket pair: what is sent to `dev` is what driverd reads."""
    dev, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    opened = []

    def fake_open(at_end: bool):
        opened.append(at_end)
        return os.dup(ours.fileno())
    monkeypatch.setattr(kmsg, "_open", fake_open)
    yield dev, opened
    dev.close()
    ours.close()


def test_every_record_is_read_until_none_is_left(device):
    dev, _ = device
    dev.send(b"6,1,1000000,-;first\n")
    dev.send(NVRM)
    assert [ln for _t, ln in kmsg.records()] == ["[    1.000000] first",
                                                  "[ 5123.456789] NVRM: driverd stand-in 550.163.01: init failure "
                                                  "requested (NVreg_StandinFailInit=1)"]
    assert kmsg.records() == []


class _Runner:
    """modprobe fails as the kernel made it fail, logging NVRM's line meanwhile; dmesg must not be started."""
    dry_run = False

    def __init__(self, dev=None) -> None:
        self.dev, self.argv = dev, []

    def run(self, argv, **kw):
        self.argv.append(argv[0])
        if os.path.basename(argv[0]) == "dmesg":
            return type("R", (), {"ok": True, "stdout": "[    1.000000] old\n[ 5123.456789] NVRM: from dmesg\n"})()
        if self.dev is not None:
            self.dev.send(NVRM)
        return type("R", (), {"ok": False, "stdout": "", "stderr": "modprobe: ERROR: could not insert 'nvidia': "
                                                                    "No such device\n"})()


def test_a_failed_load_carries_the_lines_logged_meanwhile_without_starting_dmesg(device):
    dev, opened = device
    k = RealKernel(Root("/"), _Runner(dev))
    k.live = True
    with pytest.raises(ModuleError) as e:
        k.load("nvidia", {"NVreg_StandinFailInit": "1"})
    assert e.value.details["reason"] == "No such device"
    assert e.value.details["kernel_log"] == [kmsg.parse_record(NVRM)[0][1]]
    assert [os.path.basename(a) for a in k.runner.argv] == ["modprobe"] and opened[-1] is True


def test_dmesg_marks_the_log_where_kmsg_cannot_be_read(monkeypatch):
    monkeypatch.setattr(kmsg, "_open", lambda at_end: None)
    k = RealKernel(Root("/"), _Runner())
    k.live = True
    with pytest.raises(ModuleError) as e:
        k.load("nvidia")
    assert [os.path.basename(a) for a in k.runner.argv] == ["dmesg", "modprobe", "dmesg"]
    assert e.value.details["reason"] == "No such device"
    assert k.log_mark() == 5123456789
