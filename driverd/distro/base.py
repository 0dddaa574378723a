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
from dataclasses import dataclass
from typing import ClassVar

from driverd.root import Root


@dataclass(frozen=True)
class Owned:
    """A file a package database names: its package, the package's version, and the evidence."""
    package: str
    version: str | None
    evidence: str                       # one line naming the database entry


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


def canon(p: str) -> str:
    # merged /usr: /lib/modules and /usr/lib/modules are one directory on current distributions
    return p.removeprefix("/usr") if p.startswith("/usr/lib/modules/") else p


def match(line: str, paths: list[str]) -> str:
    return next((p for p in paths if p == line or canon(p) == canon(line)), line)
