"""Have the installed kernels changed? A kernel package installs /boot/vmlinuz-<r> and /lib/modules/<r>; its
removal takes them away: either changes the directory's modification time. Compared by (inode, mtime) of
/boot and /lib/modules under the root on the loop's configuration-check timer (two stat() calls), so the
daemon's kernel watch (driverd.apply.kernelprep) prepares a kernel installed behind driverd's back in the
pass that follows, not at the next periodic one."""
from __future__ import annotations

import os

PATHS = ("/boot", "/lib/modules")


def signature(root) -> tuple:
    out = []
    for p in PATHS:
        try:
            st = os.stat(root.real(p))
            out.append((st.st_ino, st.st_mtime_ns))
        except (OSError, ValueError):
            out.append(None)
    return tuple(out)


class KernelDirs:
    def __init__(self, root) -> None:
        self.root = root
        self.last = signature(root)

    def changed(self) -> bool:
        """True once per change since the last call (or since the watch began)."""
        now = signature(self.root)
        if now == self.last:
            return False
        self.last = now
        return True
