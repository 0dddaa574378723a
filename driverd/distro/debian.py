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

from driverd.distro.base import Distro, KernelPackage, Owned, canon, match
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


# The packages that install a kernel release's image and modules: Debian's linux-image-<r> (signed) or
# linux-image-<r>-unsigned; Ubuntu's linux-image-<r> / linux-image-unsigned-<r> with linux-modules-<r>.
_KERNEL_PACKAGE = re.compile(r"linux-(?:image-unsigned|image|modules)-(.+?)(-unsigned)?")


def dpkg_kernel_packages(root: Root) -> dict[str, KernelPackage]:
    """release -> KernelPackage from /var/lib/dpkg/status (its stanzas of linux-image-*/linux-modules-*; the
    meta-packages linux-image-amd64 etc. name no release and are left out)."""
    text = root.read_text("/var/lib/dpkg/status", 64 << 20) or ""
    found: dict[str, list[tuple[str, str]]] = {}
    for stanza in text.split("\n\n"):
        stanza = stanza.lstrip("\n")
        if not stanza.startswith(("Package: linux-image-", "Package: linux-modules-")):
            continue
        fields = dict(ln.split(": ", 1) for ln in stanza.splitlines() if ": " in ln and not ln.startswith(" "))
        m = _KERNEL_PACKAGE.fullmatch(fields.get("Package", ""))
        if not m or not re.match(r"\d", m.group(1)):
            continue                    # linux-image-amd64, linux-image-cloud-amd64: meta-packages
        status = fields.get("Status", "").split()
        state = status[2] if len(status) == 3 else "unknown"
        if status[:1] in (["deinstall"], ["purge"]) and state in ("not-installed", "config-files"):
            continue                    # removed: its release is not installed through it
        found.setdefault(m.group(1), []).append((fields["Package"], state))
    out = {}
    for rel, pkgs in found.items():
        bad = next((st for _, st in pkgs if st != "installed"), None)
        out[rel] = KernelPackage(tuple(n for n, _ in pkgs), bad is None, bad or "installed")
    return out


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

    def kernel_packages(self, root: Root) -> dict[str, KernelPackage]:
        return dpkg_kernel_packages(root)
