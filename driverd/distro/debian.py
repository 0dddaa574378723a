"""Debian and its derivatives (Ubuntu): update-initramfs, the dpkg database, linux-headers-<release>.

- initramfs-tools writes /boot/initrd.img-<release>; `update-initramfs -u -k <release>` rebuilds it
  with the current /etc/modprobe.d.
- dpkg: /var/lib/dpkg/info/<package>.list lists a package's files (only lists whose package name
  contains "nvidia" are read: nvidia-*, linux-modules-nvidia-*, linux-objects-nvidia-*), and
  /var/lib/dpkg/status its version.
- Headers: linux-headers-<release> installs /usr/src/linux-headers-<release> (the output tree;
  /lib/modules/<release>/build points to it), linux-kbuild-<major.minor> /usr/lib/linux-kbuild-*
  (scripts/sign-file among them); make and gcc come with build-essential.
"""
from __future__ import annotations

import re

from driverd.distro.base import Distro, Owned, canon, match
from driverd.root import Root


def dpkg_owners(root: Root, paths: list[str]) -> dict[str, str]:
    """path -> package, from the file lists of packages whose name contains "nvidia"."""
    out: dict[str, str] = {}
    want = set(paths) | {canon(p) for p in paths}
    for lst in root.glob("/var/lib/dpkg/info", ".list"):
        name = lst.rsplit("/", 1)[-1][:-5]
        if "nvidia" not in name:
            continue
        for line in (root.read_text(lst, 16 << 20) or "").splitlines():
            if line in want or canon(line) in want:
                out.setdefault(match(line, paths), name.split(":", 1)[0])
    return out


def dpkg_version(root: Root, package: str) -> str | None:
    text = root.read_text("/var/lib/dpkg/status", 64 << 20) or ""
    m = re.search(rf"^Package: {re.escape(package)}\n(?:[^\n]+\n)*?Version: (\S+)", text, re.MULTILINE)
    return m.group(1) if m else None


def dpkg_owner_of_prefix(root: Root, prefix: str) -> str | None:
    for lst in root.glob("/var/lib/dpkg/info", ".list"):
        name = lst.rsplit("/", 1)[-1][:-5]
        if "nvidia" in name and any(line == prefix or line.startswith(prefix + "/")
                                    for line in (root.read_text(lst, 16 << 20) or "").splitlines()):
            return name.split(":", 1)[0]
    return None


class Debian(Distro):
    name = "debian"
    ids = ("debian", "ubuntu")
    manager = "dpkg"
    package_title = "Debian/Ubuntu package"
    initramfs_tool = "update-initramfs"
    headers_dirs = ("/usr/src/linux-headers-{release}",)
    headers_package = "linux-headers-{release}"
    headers_install = "apt-get install linux-headers-{release}"
    build_tools_package = "build-essential"
    kbuild_dirs = (("/usr/lib", "linux-kbuild-"), ("/usr/src", "linux-headers-"))

    def initramfs_images(self, release: str) -> tuple[str, ...]:
        return (f"/boot/initrd.img-{release}",)

    def regenerate_initramfs(self, release: str) -> list[str]:
        return ["update-initramfs", "-u", "-k", release]

    def package_owners(self, root: Root, paths: list[str]) -> tuple[dict[str, Owned], str | None]:
        dp = dpkg_owners(root, paths)
        versions = {pkg: dpkg_version(root, pkg) for pkg in sorted(set(dp.values()))}
        return {p: Owned(pkg, versions[pkg], f"/var/lib/dpkg/info/{pkg}.list names {{file}}")
                for p, pkg in dp.items()}, None

    def package_of(self, root: Root, prefix: str) -> str | None:
        return dpkg_owner_of_prefix(root, prefix)
