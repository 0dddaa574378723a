"""Has the configuration file changed? Compared by (device, inode, size, mtime) of the file the
configuration was loaded from, checked on the loop's timer: a file replaced by rename (editors,
ConfigMap updates through ..data symlinks), rewritten in place, created or removed all show."""
from __future__ import annotations

import os
from pathlib import Path


def config_file(root, explicit: str | None) -> Path | None:
    """The file driverd.config.load reads: --config / $DRIVERD_CONFIG, else <root>/etc/driverd/config.toml."""
    from driverd.config import CONFIG_PATH
    path = explicit or os.environ.get("DRIVERD_CONFIG")
    if path:
        return Path(path)
    try:
        return root.real(CONFIG_PATH)
    except OSError:
        return None


def signature(path: Path | None) -> tuple | None:
    if path is None:
        return None
    try:
        st = os.stat(path)            # follows symlinks: a ConfigMap's ..data switch changes the target
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ConfigWatch:
    def __init__(self, root, explicit: str | None) -> None:
        self.root = root
        self.explicit = explicit
        self.last = signature(config_file(root, explicit))

    def changed(self) -> bool:
        """True once per change since the last call (or since the watch began)."""
        now = signature(config_file(self.root, self.explicit))
        if now == self.last:
            return False
        self.last = now
        return True

    def mark(self) -> None:
        """The current file is the one just loaded (after a SIGHUP re-read)."""
        self.last = signature(config_file(self.root, self.explicit))
