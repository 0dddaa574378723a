"""Taking into a repository the packages the pods of a rendered build-matrix Job built (the index Job's
first half: `driverd repo index DIR --accept INCOMING --cells FILE`, driverd.build.job).

Each build pod writes into a directory of its own on the repository volume, and only there: the Job
mounts <INCOMING>/<index> at /repo for the pod of that index, so no pod can put a file where another
pod's package, or the repository itself, is. What a pod wrote is trusted for one thing only — the
package of the cell its index names (the ConfigMap's cell list, which no pod can change): here its
archive is verified against its manifest, the manifest's driver, flavour, kernel release and arch must
give exactly that cell's id, and it must be a regular file (a link a pod made is never followed). It is
then renamed into the repository (out of the pod's directory: nothing a later pod of that index does
reaches it) under its canonical name, never over a package the repository holds. Anything else is
refused and left where it is for an operator to look at. Only after this is the index written and
signed, over the repository's own packages: a package no pod's report vouches for is never signed.

What a shared volume may be trusted for, in one line: a pod's own directory for that pod's own cell;
nothing a pod can write for any other cell or for the repository as a whole.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package.archive import SUFFIX, package_filename, verify_package

# The build pods' directories inside the repository volume: hidden, so that `repo index` (which scans
# the repository's tree) never lists what only a pod vouches for.
INCOMING = ".driverd-incoming"


@dataclass
class Intake:
    """What became of the package one build pod of a Job left, when taken into the repository."""
    index: int
    cell: str
    status: str                     # accepted | refused | missing
    reason: str = ""
    package: str | None = None      # the repository path (accepted) or the pod's file (refused)
    sha256: str | None = None

    def to_json(self) -> dict:
        return {"index": self.index, "cell": self.cell, "status": self.status, "reason": self.reason,
                "package": self.package, "sha256": self.sha256}


def cell_id(m) -> str:
    """The id build-matrix gives the cell a kernel-module package is of (driverd.build.matrix.Cell.id)."""
    return f"{m.driver_version}-{m.flavor}-{m.kernel_release}-{m.arch}"


def accept(repo: str | os.PathLike, incoming: str | os.PathLike, cells: list[str]) -> list[Intake]:
    """Move the package each index's pod built for its own cell from <incoming>/<index>/ into `repo`
    (module docstring); one Intake per index and per refused file."""
    from driverd.build.modules import existing
    repo, incoming = Path(repo), Path(incoming)
    out: list[Intake] = []
    for i, cell in enumerate(cells):
        d = incoming / str(i)
        names = sorted(n for n in os.listdir(d) if n.endswith(SUFFIX) and not n.startswith(".")) \
            if d.is_dir() and not d.is_symlink() else []
        taken = False
        for n in names:
            p = d / n
            why, sha, m = _check(p, cell)
            dest = repo / package_filename(m, sha) if why is None else p
            if why is None and taken:
                why = "its pod left more than one package of its cell"
            if why is None:
                have = existing(repo, m.driver_version, m.flavor, m.kernel_release, m.arch)
                if have is not None:
                    why = f"the repository already holds {have.name}: a pod never replaces a package"
                elif os.path.lexists(dest):
                    why = f"{dest.name} is in the repository already"
            if why is not None:
                out.append(Intake(i, cell, "refused", why, str(p), sha))
                continue
            os.rename(p, dest)              # out of the pod's directory: no later pod reaches it
            taken = True
            out.append(Intake(i, cell, "accepted", "", str(dest), sha))
        if not names:
            out.append(Intake(i, cell, "missing", f"no package in {d} (the cell failed or was not built)"))
    if any(r.status == "accepted" for r in out):
        from driverd.fsutil import fsync_dir
        fsync_dir(repo)
    return out


def _check(p: Path, cell: str):
    """(why `p` is not the package of `cell` or None, its sha256, its manifest)."""
    try:
        st = os.lstat(p)
    except OSError as e:
        return f"cannot read it: {e.strerror}", None, None
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (a link a pod made is never followed)", None, None
    try:
        m = verify_package(p)
    except PackageError as e:
        return f"not a package that verifies: {e.message}", None, None
    if cell_id(m) != cell:
        return (f"it is the package of cell {cell_id(m)}, not of this index's cell {cell}: a pod may only "
                "deliver its own cell"), None, m
    from driverd.package.archive import sha256_file
    return None, sha256_file(p), m
