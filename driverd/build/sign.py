"""Finding the kernel's module signer (scripts/sign-file) for a build.

Looked up in the kernel's own headers first, then in the kbuild and headers packages installed in
the host root the build serves: with --root naming another tree, this machine's /usr is never
searched (its sign-file may belong to another kernel). On root / the PATH is the last resort."""
from __future__ import annotations

import os
import shutil

from driverd.build import host as buildhost
from driverd.root import Root


def find_sign_file(headers: str | os.PathLike | None = None, root: Root | None = None) -> str | None:
    root = root or Root("/")
    cands: list[str] = []
    if headers:
        cands.append(os.path.join(os.fspath(headers), "scripts", "sign-file"))
    for top, prefix in buildhost.family(root).kbuild_dirs:     # Debian: linux-kbuild-*, linux-headers-*
        for d in root.listdir(top):
            if d.startswith(prefix):
                cands.append(str(root.real(f"{top}/{d}/scripts/sign-file")))
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    if not root.is_slash:
        return None
    return shutil.which("sign-file") or shutil.which("kmodsign")


def signing_pair(cfg, key: str | None = None, cert: str | None = None) -> tuple[str | None, str | None]:
    """The key and certificate a build signs with: both from the command line, or both from the
    configuration ([signing] key/cert). One given alone never pairs with the other from the config:
    a key and a certificate that do not belong together make modules the kernel rejects."""
    if key or cert:
        return key, cert
    return cfg["signing.key"], cfg["signing.cert"]
