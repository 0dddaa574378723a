"""The kernel half of an install as it is recorded: the install context (every host path an install
writes for one kernel release), the tree installed now, the previous and pending records."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from driverd.driver.layout import MODULES_DIR as INSTALL_DIR
from driverd.driver.records import read_json
from driverd.errors import PackageError
from driverd.install import kept as kp
from driverd.install.kept import kept_base
from driverd.install.checks import os_errors
from driverd.package.manifest import Manifest
from driverd.root import Root
from driverd.runner import Runner

DEFAULT_STATE_DIR = "/var/lib/driverd"
PACKAGES_DIR = "packages"               # under the state dir
PREVIOUS_DIR = "packages/previous"      # <release>.json records (and, before, <release>/ trees)
FIRMWARE_BASE = "/lib/firmware/nvidia"
_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_os_errors = os_errors()


def _root(root: Root | str | os.PathLike) -> Root:
    return root if isinstance(root, Root) else Root(root)


@dataclass
class _Ctx:
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
        self.marker_hp = f"{self.pkgs_hp}/pending-{self.release}.json"
        self.prev_dir_hp = f"{self.state_dir.rstrip('/')}/{PREVIOUS_DIR}"
        self.prev_rec_hp = f"{self.prev_dir_hp}/{self.release}.json"

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


@dataclass
class _Cur:
    exists: bool
    sha: str | None = None
    manifest: Manifest | None = None
    intact: bool = False


def _current(ctx: _Ctx) -> _Cur:
    if not ctx.root.lexists(ctx.mdir_hp):
        return _Cur(False)
    d = ctx.mdir
    m, sha = kp.tree_manifest(d), kp.tree_sha(d)
    return _Cur(True, sha, m, m is not None and sha is not None and kp.modules_intact(d, m))


def installed_sha256(root: Root | str | os.PathLike, release: str) -> str | None:
    return kp.tree_sha(modules_dir(_root(root), release))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _sha_or_none(v: object) -> str | None:
    return v if kp.valid_sha(v) else None


# -- queries --------------------------------------------------------------------------------------

@_os_errors
def previous_sha(root: Root | str | os.PathLike, release: str,
                 state_dir: str = DEFAULT_STATE_DIR) -> tuple[bool, str | None]:
    """(known, sha256) of what the last install/restore for `release` replaced; sha None means no
    driverd package was installed then. known is False when nothing was ever replaced."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    rec = read_json(ctx.root, ctx.prev_rec_hp)
    if not rec or "sha256" not in rec:
        return False, None
    return True, _sha_or_none(rec["sha256"])


@_os_errors
def previous_record(root: Root | str | os.PathLike, release: str, state_dir: str = DEFAULT_STATE_DIR) -> dict | None:
    """The previous record as it is (None: absent), for a run's snapshot to put back when it rolls back."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    return read_json(ctx.root, ctx.prev_rec_hp)


@_os_errors
def put_previous_record(root: Root | str | os.PathLike, release: str, rec: dict | None,
                        state_dir: str = DEFAULT_STATE_DIR) -> None:
    """Make the previous record `rec` again (None: none). A failed run's rollback does this after its
    restore: the package the run failed with must not become what `driverd rollback` goes back to."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    if rec is None:
        ctx.root.unlink(ctx.prev_rec_hp)
    else:
        ctx.root.makedirs(ctx.prev_dir_hp)
        ctx.root.atomic_write_json(ctx.prev_rec_hp, rec)


@_os_errors
def is_installed(root: Root | str | os.PathLike, release: str, sha256: str | None,
                 state_dir: str = DEFAULT_STATE_DIR) -> bool:
    """The package `sha256` (None: no driverd package) is installed for `release`, complete: its
    install record names it, no switch is pending and every module file has its manifest size."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    if ctx.root.lexists(ctx.marker_hp):
        return False
    cur = _current(ctx)
    if sha256 is None:
        return not cur.exists
    return cur.intact and cur.sha == sha256


def modules_dir(root: Root, release: str) -> Path:
    return root.real(f"/lib/modules/{release}/{INSTALL_DIR}")


def firmware_dir(root: Root, version: str) -> Path:
    return root.real(f"{FIRMWARE_BASE}/{version}")


def kept_dir(root: Root, sha256: str, state_dir: str = DEFAULT_STATE_DIR) -> Path:
    return kept_base(root, state_dir) / kp.check_sha(sha256)
