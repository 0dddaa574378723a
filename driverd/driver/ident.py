"""DriverId: which driver (version, flavour) — the one shape driverd gives it. The kernel's own report,
/proc/driver/nvidia/version, is parsed here and nowhere else."""
from __future__ import annotations

import re
from collections.abc import Mapping

from driverd.datatypes import NamedTuple

# Light on purpose: detect asks for VERSION_FILE before it has imported anything else of driverd's
# (driverd.host.start_early), so neither the root's module nor dataclasses come with it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.root import Root

VERSION_FILE = "/proc/driver/nvidia/version"
FLAVORS = ("open", "proprietary")
# NVIDIA driver versions: 3-digit branch today (96.43.23 and 1xx.yy existed; allow 2-4 digits).
_VERSION_RE = re.compile(r"(?<![\w.])(\d{2,4}\.\d{1,3}(?:\.\d{1,3})?)(?![\w.])")


# A NamedTuple rather than a frozen dataclass: `detect` and every status read build this module, and a
# NamedTuple class costs a sixth of one to make.
class DriverId(NamedTuple):
    version: str
    flavor: str = ""            # open | proprietary | "" (not known: a record that did not say)

    def __str__(self) -> str:
        return f"{self.version} ({self.flavor})" if self.flavor else self.version

    def as_dict(self) -> dict[str, str]:
        """The JSON shape records, annotations and outputs carry: {"version", "flavor"}."""
        return {"version": self.version, "flavor": self.flavor}

    @classmethod
    def from_dict(cls, doc: Mapping | None) -> "DriverId | None":
        """From {"version", "flavor"} as a record holds it; None for anything without a version."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("version"), str) or not doc["version"]:
            return None
        return cls(doc["version"], str(doc.get("flavor") or ""))


def parse_version_file(text: str | None) -> tuple[str | None, str | None, str | None]:
    """(version, flavour, first line) from /proc/driver/nvidia/version.

    nv-procfs.c nv_procfs_read_version() prints "NVRM version: %s\\n" with the driver's NVRM id,
    then "GCC version:  %s\\n". The id names the architecture and flavour before the version:
      proprietary: 'NVIDIA UNIX x86_64 Kernel Module  535.261.03  <date>'
                   (also aarch64/ppc64le, legacy 470/390, and 'Kernel Module for GRID'/vGPU builds)
      open:        'NVIDIA UNIX Open Kernel Module for x86_64  535.261.03  Release Build  (...)  <date>'
    """
    if not text:
        return None, None, None
    first = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("NVRM version")), None)
    if first is None:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return None, None, (lines[0][:200] if lines and lines[0].isprintable() else None)
    ident = first.partition(":")[2]
    if "Kernel Module" not in ident:
        return None, None, first[:200] if first.isprintable() else None
    m = _VERSION_RE.search(ident.split("Kernel Module", 1)[1])
    flavor = "open" if "Open Kernel Module" in ident else "proprietary"
    return (m.group(1) if m else None), flavor, first[:200]


def loaded(root: Root) -> DriverId | None:
    """The driver the kernel runs now (None: no nvidia module, or a report without a version)."""
    version, flavor, _ = parse_version_file(root.read_text(VERSION_FILE))
    return None if version is None else DriverId(version, flavor or "")
