"""The kernel half of an install as it is recorded: the install context (every host path an install
writes for one kernel release), the tree installed now, the previous and pending records."""
from __future__ import annotations

import functools
import os
import re
from datetime import UTC, datetime
from pathlib import Path

from driverd.datatypes import dataclass
from driverd.driver import layout
from driverd.driver.layout import MODULES_DIR as INSTALL_DIR
from driverd.driver.modules import ModulesTree, current_tree
from driverd.driver.modules import installed_sha256 as _installed_sha256
from driverd.driver.modules import is_installed as _is_installed
from driverd.driver.modules import previous_record as _previous_record
from driverd.driver.modules import previous_sha as _previous_sha
from driverd.errors import PackageError
from driverd.install import kept as kp
from driverd.install.kept import kept_base
from driverd.install.checks import os_errors
from driverd.root import Root
from driverd.runner import Runner

DEFAULT_STATE_DIR = layout.DEFAULT_STATE_DIR
PACKAGES_DIR = layout.PACKAGES_DIR
PREVIOUS_DIR = layout.PREVIOUS_DIR      # <release>.json records (and, before, <release>/ trees)
FIRMWARE_BASE = layout.FIRMWARE_BASE
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_os_errors = os_errors()


def _root(root: Root | str | os.PathLike) -> Root:
    return root if isinstance(root, Root) else Root(root)


@dataclass
class _Ctx:
    """The install context of one kernel release: every host path an install for it writes."""
    root: Root
    release: str
    runner: Runner
    state_dir: str
    given_tools: object = None      # a driverd.kmod.kernel.Kernel; None: the real one (kmod), made on first use

    def __post_init__(self) -> None:
        if not _RELEASE.fullmatch(self.release or ""):
            raise PackageError(f"kernel release {self.release!r} is not a plain name",
                               fix="pass the release as `uname -r` prints it")
        # Host paths: what every write names (through the Root's confined writers).
        self.mdir_hp = f"/lib/modules/{self.release}/{INSTALL_DIR}"
        self.updates_hp = os.path.dirname(self.mdir_hp)
        self.pkgs_hp = f"{self.state_dir.rstrip('/')}/{PACKAGES_DIR}"
        self.marker_hp = layout.modules_marker(self.state_dir, self.release)
        self.prev_dir_hp = f"{self.state_dir.rstrip('/')}/{PREVIOUS_DIR}"
        self.prev_rec_hp = layout.modules_previous(self.state_dir, self.release)

    # Real paths, resolved inside the root when asked: for reading and for reports.
    @property
    def mdir(self) -> Path:
        return self.root.real(self.mdir_hp)

    @property
    def marker(self) -> Path:
        return self.root.real(self.marker_hp)

    def fw_hp(self, version: str) -> str:
        if not _RELEASE.fullmatch(version or ""):
            raise PackageError(f"driver version {version!r} is not a plain name",
                               cause="a manifest or a pending-switch record names it", fix="reinstall the package")
        return f"{FIRMWARE_BASE}/{version}"

    def fw(self, version: str) -> Path:
        return self.root.real(self.fw_hp(version))

    @functools.cached_property
    def tools(self):
        if self.given_tools is not None:
            return self.given_tools
        from driverd.kmod.kernel import RealKernel
        return RealKernel(self.root, self.runner)


def _current(ctx: _Ctx) -> ModulesTree:
    return current_tree(ctx.root, ctx.release)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _sha_or_none(v: object) -> str | None:
    return v if kp.valid_sha(v) else None


# -- queries: driver/modules.py's readers, with the release checked and OS errors said as driverd's -------

@_os_errors
def installed_sha256(root: Root | str | os.PathLike, release: str) -> str | None:
    return _installed_sha256(_root(root), release)


@_os_errors
def previous_sha(root: Root | str | os.PathLike, release: str,
                 state_dir: str = DEFAULT_STATE_DIR) -> tuple[bool, str | None]:
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    return _previous_sha(ctx.root, release, state_dir)


@_os_errors
def previous_record(root: Root | str | os.PathLike, release: str, state_dir: str = DEFAULT_STATE_DIR) -> dict | None:
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    return _previous_record(ctx.root, release, state_dir)


@_os_errors
def is_installed(root: Root | str | os.PathLike, release: str, sha256: str | None,
                 state_dir: str = DEFAULT_STATE_DIR) -> bool:
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    return _is_installed(ctx.root, release, sha256, state_dir)


def modules_dir(root: Root, release: str) -> Path:
    return root.real(f"/lib/modules/{release}/{INSTALL_DIR}")


def firmware_dir(root: Root, version: str) -> Path:
    return root.real(f"{FIRMWARE_BASE}/{version}")


def kept_dir(root: Root, sha256: str, state_dir: str = DEFAULT_STATE_DIR) -> Path:
    return kept_base(root, state_dir) / kp.check_sha(sha256)
