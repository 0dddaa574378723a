"""The kernel's log read from /dev/kmsg by driverd itself, in dmesg's words, without starting dmesg.

A reload loads and unloads modules one by one and keeps each attempt's kernel lines for its error: a
`dmesg` process per mark read and parsed the whole ring buffer every time (nine times a reload). A
`Tail` opened at the log's end before an attempt reads only what the attempt logged, and only when it
failed. Each record /dev/kmsg gives (Documentation/ABI/testing/dev-kmsg) is
`PRIO,SEQ,TS_USEC,FLAGS[,...];MESSAGE` with non-printable bytes and `\\` escaped as `\\xNN`, then
dictionary lines (` KEY=value`); its line here is dmesg's: `[%5d.%06d] MESSAGE` (seconds.microseconds
since boot), the stamp the marks compare. /dev/kmsg is the kernel's one log in every mount namespace
(the driver container's too); where it cannot be read (no device, dmesg_restrict without CAP_SYSLOG)
the caller falls back to dmesg.
"""
from __future__ import annotations

import errno
import os
import re

KMSG = "/dev/kmsg"
_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


def parse_record(record: bytes) -> list[tuple[int, str]]:
    """(µs since boot, line) for one /dev/kmsg record: one line per line of its message, each with the
    record's stamp (dmesg prints a multi-line record's stamp once; the stamp is what marks compare)."""
    head, sep, body = record.partition(b";")
    fields = head.split(b",")
    if not sep or len(fields) < 3:
        return []
    try:
        ts = int(fields[2])
    except ValueError:
        return []
    text = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 16)]), body.split(b"\n", 1)[0])
    stamp = f"[{ts // 1_000_000:5d}.{ts % 1_000_000:06d}] "
    return [(ts, stamp + ln) for ln in text.decode("utf-8", "replace").split("\n")]


def _open(at_end: bool) -> int | None:
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if at_end:
            os.lseek(fd, 0, os.SEEK_END)
    except OSError:
        os.close(fd)
        return None
    return fd


def _read(fd: int) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    while True:
        try:
            rec = os.read(fd, 16384)            # one record per read
        except BlockingIOError:
            return out                          # nothing more now
        except InterruptedError:
            continue
        except OSError as e:
            if e.errno == errno.EPIPE:          # records overwritten before they were read: go on from the oldest left
                continue
            return out
        if not rec:
            return out
        out += parse_record(rec)


def records() -> list[tuple[int, str]] | None:
    """Every line in the kernel's log now, oldest first; None when /dev/kmsg cannot be read."""
    fd = _open(at_end=False)
    if fd is None:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


class Tail:
    """The kernel log from the moment it is opened: `lines()` returns what was logged since (None when
    /dev/kmsg cannot be read: `ok` is False and the caller marks the log another way)."""

    def __init__(self) -> None:
        self.fd = _open(at_end=True)

    @property
    def ok(self) -> bool:
        return self.fd is not None

    def lines(self) -> list[str] | None:
        return None if self.fd is None else [ln for _t, ln in _read(self.fd)]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "Tail":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
