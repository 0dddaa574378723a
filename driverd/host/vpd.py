"""PCI Vital Product Data, as the kernel hands it out in /sys/bus/pci/devices/<addr>/vpd.

The format (PCI Local Bus Specification 3.0, section 6.4 and appendix I; PCIe Base Specification,
"Vital Product Data"; the kernel walks the same tags in drivers/pci/vpd.c, pci_vpd_size): a list of
resource data items —

- large items: one tag byte with bit 7 set (bits 6..0: the item name), a 16-bit little-endian length,
  the data. 0x82 is the identifier string (the product name), 0x90 VPD-R (read-only keywords), 0x91
  VPD-W (read-write keywords);
- small items: one tag byte with bit 7 clear (bits 6..3: the item name, bits 2..0: the length). The end
  tag is item 0x0F of length 0: the byte 0x78.

VPD-R and VPD-W hold keywords: two ASCII characters, a length byte, the data. PN, EC, SN, MN name the
part; V0..VZ are the vendor's own, Y0..YZ the system's; RV's first byte is a checksum that makes the
sum of every byte from the start of the VPD through it zero (modulo 256), and the rest of RV is reserved.

Read-only and defensive: sysfs gives whatever the device's EEPROM holds (older kernels pad the file to
32 KiB with 0xff or zeros), so parsing stops at the end tag or at the first item that does not fit and
says why; what was read up to there stays.
"""
from __future__ import annotations

from typing import NamedTuple

TAG_ID_STRING = 0x82
TAG_VPD_R = 0x90
TAG_VPD_W = 0x91
TAG_END = 0x78
MAX_SIZE = 1 << 15                 # the VPD address is 15 bits: nothing beyond 32 KiB is VPD


class Vpd(NamedTuple):
    identifier: str | None                     # the 0x82 string
    readonly: tuple[tuple[str, bytes], ...]    # VPD-R keywords in order (RV included)
    writable: tuple[tuple[str, bytes], ...]    # VPD-W keywords
    checksum_ok: bool | None                   # None: no RV keyword
    problem: str | None                        # why parsing stopped before an end tag, else None

    def text(self, keyword: str) -> str | None:
        """A read-only keyword's value as text (NUL and space padding stripped), None when absent."""
        for k, v in self.readonly:
            if k == keyword:
                return v.decode("latin-1").rstrip("\x00 ")
        return None


def _keywords(data: bytes) -> tuple[list[tuple[str, bytes]], int | None, str | None]:
    """(keywords, offset of RV's checksum byte inside `data`, a problem) of one VPD-R/VPD-W item."""
    out, rv_at, i = [], None, 0
    while i + 3 <= len(data):
        key, n = data[i:i + 2], data[i + 2]
        if not (key.isascii() and key.isalnum()):
            if key == b"\x00\x00" or key == b"\xff\xff":     # unused space at the end of the item
                break
            return out, rv_at, f"keyword bytes {key!r} at offset {i} are not a keyword"
        if i + 3 + n > len(data):
            return out, rv_at, f"keyword {key.decode()} runs past the end of its item"
        name = key.decode()
        out.append((name, data[i + 3:i + 3 + n]))
        if name == "RV" and n >= 1:
            rv_at = i + 3
        i += 3 + n
    return out, rv_at, None


def parse(raw: bytes) -> Vpd:
    """The items of a VPD image; never raises."""
    raw = raw[:MAX_SIZE]
    ident: str | None = None
    ro: list[tuple[str, bytes]] = []
    rw: list[tuple[str, bytes]] = []
    checksum: bool | None = None
    i = 0
    while i < len(raw):
        tag = raw[i]
        if tag == TAG_END:
            return Vpd(ident, tuple(ro), tuple(rw), checksum, None)
        if not tag & 0x80:                       # another small item: skip it by its own length
            i += 1 + (tag & 0x07)
            continue
        if tag == 0xFF:                          # erased EEPROM, or an older kernel's padding
            break
        if i + 3 > len(raw):
            break
        size = raw[i + 1] | raw[i + 2] << 8
        start = i + 3
        if start + size > len(raw):
            return Vpd(ident, tuple(ro), tuple(rw), checksum,
                       f"item 0x{tag:02x} at offset {i} claims {size} bytes; only {len(raw) - start} follow")
        data = raw[start:start + size]
        if tag == TAG_ID_STRING:
            ident = data.decode("latin-1").rstrip("\x00 ")
        elif tag in (TAG_VPD_R, TAG_VPD_W):
            words, rv_at, problem = _keywords(data)
            (ro if tag == TAG_VPD_R else rw).extend(words)
            if tag == TAG_VPD_R and rv_at is not None:
                checksum = sum(raw[:start + rv_at + 1]) & 0xFF == 0
            if problem:
                return Vpd(ident, tuple(ro), tuple(rw), checksum, problem)
        i = start + size
    return Vpd(ident, tuple(ro), tuple(rw), checksum, "no end tag (0x78)" if raw else "empty")


def vendor_fields(vpd: Vpd) -> dict[str, str]:
    """The KEY=VALUE fields NVIDIA's (Mellanox's) adapters pack into their vendor-specific keywords,
    colon-separated — e.g. VA "MLX:MN=MLNX:CSKU=V2:UUID=V3:PCI=V0:MODL=CX75310A" — from every V* and Y*
    keyword of VPD-R; the first value of a key wins."""
    out: dict[str, str] = {}
    for k, v in vpd.readonly:
        if k[0] in "VY":
            for part in v.decode("latin-1").rstrip("\x00 ").split(":"):
                key, eq, val = part.partition("=")
                if eq and key.strip():
                    out.setdefault(key.strip(), val.strip())
    return out
