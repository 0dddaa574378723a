"""The kernel half as it is on disk: the driverd package installed for a kernel release
(/lib/modules/<release>/updates/driverd/: its manifest and install record). Light on purpose: `driverd
detect` reads it on every call."""
from __future__ import annotations

import json
from typing import NamedTuple

from driverd.driver import layout
from driverd.driver.ident import DriverId
from driverd.driver.records import read_json
from driverd.root import Root


class InstalledModules(NamedTuple):
    """The kernel half driverd installed for one kernel release."""
    driver: DriverId
    kernel_release: str
    package_sha256: str | None
    path: str                               # host path of its manifest


def installed_modules(root: Root, release: str | None, warnings: list[str] | None = None) -> InstalledModules | None:
    """The driverd package installed for `release` (None: none, or a damaged manifest: not usable)."""
    if not release:
        return None
    base = layout.modules_dir(release)
    path = f"{base}/{layout.MODULES_MANIFEST}"
    text = root.read_text(path)
    if text is None:
        return None
    try:
        m = json.loads(text)
        fields = (m["kernel"]["release"], m["driver"]["version"], m["flavor"])
        if not all(isinstance(f, str) and f for f in fields):
            raise TypeError("manifest fields are not strings")
        rec = read_json(root, f"{base}/{layout.MODULES_RECORD}") or {}
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        if warnings is not None:
            warnings.append(f"{path}: unreadable driverd manifest ({e.__class__.__name__}); treated as not installed")
        return None
    sha = rec.get("package_sha256")
    return InstalledModules(DriverId(fields[1], fields[2]), fields[0], sha if isinstance(sha, str) else None, path)
