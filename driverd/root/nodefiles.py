"""Files of the node's configuration that driverd trusts: keys, certificates and credentials, found under
the root and refused when anyone but root can change them."""
from __future__ import annotations

from driverd.root import Root


def node_path(root: Root, path: str | None, what: str = "key or credential file") -> str | None:
    """A key, certificate or credential path of the node's configuration (signing.key, signing.cert,
    signing.trusted_certs, packages.index_public_key, packages.netrc, packages.auth_header_file): a host
    path, resolved under --root (symlinks followed inside it), and refused (ConfigError) when anyone but
    root can change it (driverd.fsutil.trusted_file: owner, mode, every directory on the way; `what`
    names it in the message). A missing file is returned as is: its reader says it is missing. `driverd
    build` and `repo index` take the build host's own paths instead."""
    if path is None:
        return None
    from driverd.fsutil import trusted_file
    real = path if root.is_slash else str(root.real(path))
    checked = trusted_file(real, what, shown=path, missing_ok=True)
    return real if checked is None else str(checked)
