"""The NVIDIA driver of one version on this host, every part of it: its identity (ident.py), the paths
driverd owns for it (layout.py), the one reader of what the host runs and has (state.py) and the
user-space file finder (files.py). Nothing here changes a host; install/ writes, through its layout."""
