"""What driverd keeps for a kernel that is no longer installed, and its removal."""
from __future__ import annotations

import os

from driverd.errors import PackageError
from driverd.install import kept as kp
from driverd.install.checks import os_errors
from driverd.install.kept import kept_base
from driverd.install.records import DEFAULT_STATE_DIR, _Ctx, _root
from driverd.root import Root
from driverd.runner import Runner

_os_errors = os_errors()


def release_leftovers(root: Root | str | os.PathLike, release: str, state_dir: str = DEFAULT_STATE_DIR) -> list[str]:
    """What driverd still keeps for kernel `release` (host paths): its installed tree under /lib/modules (left
    behind when the kernel's package was removed: the package manager removes only its own files), its
    previous and pending records, and the kept packages built for it."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    out = [hp for hp in (ctx.mdir_hp, ctx.prev_rec_hp, ctx.marker_hp) if ctx.root.lexists(hp)]
    base = kp.kept_hostdir(state_dir)
    for sha in kp.kept_shas(ctx.root, state_dir):
        m = kp.tree_manifest(kept_base(ctx.root, state_dir) / sha / "modules")
        if m is not None and m.kernel_release == release:
            out.append(f"{base}/{sha}")
    return out


@_os_errors
def forget_release(root: Root | str | os.PathLike, release: str, state_dir: str = DEFAULT_STATE_DIR) -> list[str]:
    """Remove what driverd keeps for kernel `release`, a kernel that is no longer installed (its boot image
    and its own modules are gone): release_leftovers, then /lib/modules/<release> when nothing else is
    left in it. A kernel that still has its image or its modules is refused. Returns what was removed."""
    ctx = _Ctx(_root(root), release, Runner(), state_dir)
    r = ctx.root
    if r.lexists(f"/boot/vmlinuz-{release}") or r.lexists(f"/lib/modules/{release}/kernel") or \
            r.lexists(f"/lib/modules/{release}/vmlinuz"):
        raise PackageError(f"kernel {release} is still installed: driverd keeps its package",
                           cause=f"/boot/vmlinuz-{release} or /lib/modules/{release}/kernel is there",
                           fix="remove the kernel's package first")
    removed = release_leftovers(r, release, state_dir)
    for hp in removed:
        if hp.startswith(kp.kept_hostdir(state_dir) + "/"):
            kp.retire(r, hp)
        elif r.is_dir(hp):
            kp.retire(r, hp)
        else:
            r.unlink(hp)
    for d in (ctx.updates_hp, f"/lib/modules/{release}"):
        if r.is_dir(d) and not r.listdir(d):
            r.rmdir(d)
            removed.append(d)
    return removed
