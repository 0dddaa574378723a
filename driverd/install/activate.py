"""Making a user-space tree the one the node's processes get: the loader configuration and cache
(`ldconfig -X`), the PATH links to its binaries and the driver-root link, each only where the name is
free and removed only when it is driverd's; what is not to be active is taken back the same way."""
from __future__ import annotations

from driverd.driver.layout import LDCONF, Places
from driverd.driver.records import read_json
from driverd.driver.userspace import Tree, ldconf_ours, link_state, our_links, path_clash, wanted_links
from driverd.errors import DriverdError, PackageError
from driverd.root import Root
from driverd.runner import Runner


def activate_tree(root: Root, runner: Runner, places: Places, target: Tree | None, activate: bool) -> list[str]:
    """Point `current` at `target` and make the loader configuration and the PATH links what they must be
    (each step idempotent)."""
    notes: list[str] = []
    if target is not None:
        root.symlink(places.current, target.name)
    else:
        root.unlink(places.current)
    changed_ld = False
    if activate:
        if not ldconf_ours(root, places):
            root.atomic_write(LDCONF, places.ldconf_text(), 0o644)
            changed_ld = True
    elif root.lstat(LDCONF) is not None:
        root.unlink(LDCONF)
        changed_ld = True
    ldconfig(root, runner)               # the cache names files of the tree just switched to: always rebuilt
    if places.bin_dir:
        want = wanted_links(root, places, target.manifest) if activate and target else set()
        if activate and target is not None and target.manifest is not None:
            for name in sorted({b.rpartition("/")[2] for b in target.manifest.binaries} - want):
                clash = path_clash(root, places, name)
                where = f"({name} is at {places.current}/bin/{name})"
                notes.append(f"{clash} is not driverd's: left alone {where}" if clash == f"{places.bin_dir}/{name}"
                             else f"{places.bin_dir}/{name} is not linked: {clash} is on PATH too, and a link would "
                                  f"shadow it or be shadowed by it {where}")
        mine = our_links(root, places)
        for name in sorted(set(mine) - want):
            root.unlink(f"{places.bin_dir}/{name}")
        # every link is recorded before it is made: a process killed in between leaves a name whose link
        # is not there, which our_links ignores
        rec = read_json(root, places.links_record)
        if (rec or {}).get("links") != sorted(want) and (rec is not None or want):
            root.atomic_write_json(places.links_record, {"bin_dir": places.bin_dir, "links": sorted(want)})
        for name in sorted(want - set(mine)):
            try:
                root.symlink(f"{places.bin_dir}/{name}", places.bin_target(name), replace=False)
            except FileExistsError:
                notes.append(f"{places.bin_dir}/{name} is not driverd's: left alone ({name} is at "
                             f"{places.current}/bin/{name})")
    if changed_ld:
        notes.append(f"{'wrote' if activate else 'removed'} {LDCONF}")
    notes += driver_link(root, places, activate and target is not None)
    return notes


def driver_link(root: Root, places: Places, want: bool) -> list[str]:
    """Make userspace.driver_link (/run/nvidia/driver) driverd's link to `current` when `want` and the name
    is free; remove it when not `want` and it is driverd's. Anything else there is left alone."""
    state = link_state(root, places)
    if state is None:
        return []
    link = places.driver_link
    if want and state == "free":
        try:
            root.symlink(link, places.link_target(root), replace=False)
        except FileExistsError:
            state = "other"
        else:
            return [f"linked {link} to {places.current} (the toolkit's driver root)"]
    if want and state == "other":
        return [f"{link} is not driverd's: left alone (nvidia-container-toolkit's driver root there is not "
                f"driverd's tree; point it at {places.current} with NVIDIA_CTK_DRIVER_ROOT / --driver-root, or "
                f"remove {link})"]
    if not want and state == "ours":
        root.unlink(link)
        return [f"removed {link}"]
    return []


def ldconfig(root: Root, runner: Runner) -> None:
    argv = ["ldconfig", "-X"] + ([] if root.is_slash else ["-r", root.base])
    try:
        res = runner.run(argv, timeout=300, check=False)
    except DriverdError as e:
        raise PackageError(f"cannot rebuild the loader cache: {e.message}", cause=e.cause,
                           fix="install glibc's ldconfig (Debian: libc-bin)") from None
    if not res.ok:
        raise PackageError(f"ldconfig failed: {res.first_error_line()}", cause=" ".join(argv),
                           fix="check the host's /etc/ld.so.conf and that its file system is writable")
