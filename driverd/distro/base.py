"""What a distribution family tells driverd: the `Distro` base class, one subclass per family
(`debian.py`, `rpm.py`), listed in `driverd/distro/__init__.py`.

A family answers, for the host (or build host) it runs on:
- who it is: the os-release(5) ID / ID_LIKE values that name it;
- initramfs: the image names its tools write for a kernel, and the command that regenerates one;
- package ownership: which of its packages owns a kernel-module file (its package database, read
  only), and which package ships a directory (DKMS sources);
- build dependencies: where its kernel headers live, which package provides them and the compiler.
Every answer is data or a read-only lookup under the root; nothing here runs a command.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from driverd.datatypes import dataclass
from driverd.root import Root

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import ClassVar


@dataclass(frozen=True)
class Owned:
    """A file a package database names: its package, the package's version, and the evidence."""
    package: str
    version: str | None
    evidence: str                       # one line naming the database entry


@dataclass(frozen=True)
class KernelPackage:
    """The package database's record of a kernel release's package(s): their names and whether every one
    of them is completely installed (dpkg's "install ok installed"); `state` names the first that is not."""
    names: tuple[str, ...]
    installed: bool
    state: str                          # "installed", or e.g. "half-installed", "unpacked", "half-configured"


def _order(c: str) -> int:
    # dpkg's lib/dpkg/version.c order(): digits 0, letters their code, '~' before everything, others after letters
    if c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    if c == "~":
        return -1
    return ord(c) + 256 if c else 0


def compare_versions(a: str, b: str) -> int:
    """dpkg's verrevcmp (`dpkg --compare-versions`, what Debian's `linux-version sort` orders kernel releases
    with): < 0, 0, > 0. Runs of non-digits compare by _order, runs of digits numerically."""
    i = j = 0
    while i < len(a) or j < len(b):
        first_diff = 0
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            if not first_diff:
                first_diff = ord(a[i]) - ord(b[j])
            i += 1
            j += 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


class Distro(ABC):
    name: ClassVar[str]                         # the family: a build matrix cell's `distro`
    ids: ClassVar[tuple[str, ...]]              # os-release ID / ID_LIKE values of the family
    manager: ClassVar[str]                      # its package manager, as ownership reports it (dpkg, rpm)
    package_title: ClassVar[str]                # "Debian/Ubuntu package"
    initramfs_tool: ClassVar[str]               # the program that builds its initramfs images

    def matches(self, os_id: str, id_like: tuple[str, ...]) -> bool:
        return bool({os_id, *id_like} & set(self.ids))

    # -- initramfs -----------------------------------------------------------------------------------
    @abstractmethod
    def initramfs_images(self, release: str) -> tuple[str, ...]:
        """The image paths its tools write for `release`, most likely first."""

    @abstractmethod
    def regenerate_initramfs(self, release: str) -> list[str]:
        """The command that rebuilds the image for `release` (modprobe.d included)."""

    # -- package ownership ---------------------------------------------------------------------------
    @abstractmethod
    def package_owners(self, root: Root, paths: list[str]) -> tuple[dict[str, Owned], str | None]:
        """path -> Owned for the NVIDIA packages of its database that name one of `paths`, and a note
        when the database exists but could not be read. Read-only, bounded, never raises."""

    def package_of(self, root: Root, prefix: str) -> str | None:
        """The NVIDIA package that ships `prefix` (a directory: DKMS sources), None when unknown."""
        return None

    def unread_owner(self, paths: list[str], note: str) -> tuple[tuple[str, ...], str] | None:
        """When its database could not be read (`note`): the files that are where its packages put
        modules, and the evidence; None when nothing can be said."""
        return None

    # -- build dependencies --------------------------------------------------------------------------
    headers_dirs: ClassVar[tuple[str, ...]] = ()        # "{release}" templates, after /lib/modules/<r>/build
    headers_package: ClassVar[str | None] = None        # "{release}" template; None: the family has no build knowledge
    headers_install: ClassVar[str | None] = None        # "{release}" template: the command that installs it
    build_tools_package: ClassVar[str | None] = None    # provides make and the compiler
    kbuild_dirs: ClassVar[tuple[tuple[str, str], ...]] = ()   # (dir, name prefix) of installed kbuild/headers trees

    def headers_for(self, release: str) -> list[str]:
        return [d.format(release=release) for d in self.headers_dirs]

    # -- installed kernels ---------------------------------------------------------------------------
    def kernel_images(self, root: Root) -> dict[str, str]:
        """release -> the boot image its kernel package installed (host paths, read-only): /boot/vmlinuz-<r>."""
        return {n[len("vmlinuz-"):]: f"/boot/{n}" for n in root.listdir("/boot")
                if n.startswith("vmlinuz-") and len(n) > len("vmlinuz-") and root.is_file(f"/boot/{n}")}

    def kernel_packages(self, root: Root) -> dict[str, KernelPackage]:
        """release -> its kernel package(s) as the package database records them; {} when unknown."""
        return {}

    def kernel_install_problems(self, root: Root, release: str) -> list[str]:
        """What the family's kernel installation left undone for `release` (beyond the package database),
        each one line with its fix."""
        return []

    def compare_releases(self, a: str, b: str) -> int:
        """The order the family's boot loader configuration sorts kernel releases in (newest = largest)."""
        return compare_versions(a, b)


def canon(p: str) -> str:
    # merged /usr: /lib/modules and /usr/lib/modules are one directory on current distributions
    return p.removeprefix("/usr") if p.startswith("/usr/lib/modules/") else p


def match(line: str, paths: list[str]) -> str:
    return next((p for p in paths if p == line or canon(p) == canon(line)), line)
