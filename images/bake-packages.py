#!/usr/bin/env python3
"""What `images/build-image.sh --packages REPO [--package NAME ...]` puts into the driver image at
/opt/driverd/packages: the repository's index (index.json, and index.json.sig when it is signed,
copied byte for byte so the signature still holds) and the package files that index names — all of
them, or only the ones asked for — and nothing else of the directory: not the key the index was
signed with, not build logs, not a file someone left there.

  bake-packages.py --out DIR REPO [NAME ...]     NAME: a package the index names (its path in the index
                                                 or its file name)

Refused, in one line and with nothing written (exit 2): a missing or malformed index, a NAME the index
does not name, a package path that leaves the repository, a package that is a symbolic link or is
reached through one, or not a regular file, or whose size or sha256 is not the index's. Each package is
hashed as it is copied: the bytes in the image are the bytes checked. Standard library only (it runs on
the build machine's python3).
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

INDEX, SIG = "index.json", "index.json.sig"
MAX_INDEX = 32 << 20


class Refused(Exception):
    pass


def _open_in(repo: Path, rel: str) -> int:
    """Open repo/rel for reading, refusing a symbolic link anywhere below the repository."""
    parts = rel.split("/")
    if rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"the index names {rel!r}, a path that leaves the repository")
    fd = os.open(repo, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, p in enumerate(parts):
            flags = os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if i < len(parts) - 1 else 0)
            try:
                nfd = os.open(p, flags, dir_fd=fd)
            except OSError as e:
                try:
                    link = stat.S_ISLNK(os.stat(p, dir_fd=fd, follow_symlinks=False).st_mode)
                except OSError:
                    link = False
                what = "is a symbolic link" if link or e.errno == errno.ELOOP else (e.strerror or str(e)).lower()
                raise Refused(f"{repo / '/'.join(parts[:i + 1])} {what}") from None
            os.close(fd)
            fd = nfd
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Refused(f"{repo / rel} is not a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


def _entries(repo: Path) -> tuple[bytes, list[dict]]:
    fd = _open_in(repo, INDEX)
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_INDEX + 1)
    if len(data) > MAX_INDEX:
        raise Refused(f"{repo / INDEX} is larger than {MAX_INDEX >> 20} MiB")
    try:
        doc = json.loads(data)
        pkgs = doc["packages"]
        out = [{"path": str(p["path"]), "sha256": str(p["sha256"]), "size": int(p["size"])} for p in pkgs]
    except (ValueError, KeyError, TypeError) as e:
        raise Refused(f"{repo / INDEX} is not a driverd repository index ({e.__class__.__name__}: {e}); "
                      f"run `driverd repo index {repo}`") from None
    for e in out:
        if not re.fullmatch(r"[0-9a-f]{64}", e["sha256"]):
            raise Refused(f"{repo / INDEX}: {e['path']} has no valid sha256")
    return data, out


def bake(repo: Path, out: Path, names: list[str]) -> tuple[list[str], list[str]]:
    """Copy the index and the packages into `out` (created; must not exist). Returns (the packages
    copied, the files of the repository left out)."""
    repo = Path(os.path.realpath(repo))
    data, entries = _entries(repo)
    by_path = {e["path"]: e for e in entries}
    by_name: dict[str, list[dict]] = {}
    for e in entries:
        by_name.setdefault(e["path"].rsplit("/", 1)[-1], []).append(e)
    if names:
        chosen = []
        for n in names:
            n = n.removeprefix(str(repo) + "/")
            hits = [by_path[n]] if n in by_path else by_name.get(n, [])
            if len(hits) != 1:
                raise Refused(f"{n} is not a package {repo / INDEX} names" if not hits else
                              f"{n} names {len(hits)} packages of {repo / INDEX}: give its path in the index")
            chosen.append(hits[0])
    else:
        chosen = entries
    out.mkdir(parents=True)
    try:
        (out / INDEX).write_bytes(data)
        if os.path.lexists(repo / SIG):
            with os.fdopen(_open_in(repo, SIG), "rb") as f:
                (out / SIG).write_bytes(f.read(1 << 16))
        for e in chosen:
            dest = out / e["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            h, size = hashlib.sha256(), 0
            with os.fdopen(_open_in(repo, e["path"]), "rb") as src, open(dest, "xb") as dst:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
            if (size, h.hexdigest()) != (e["size"], e["sha256"]):
                raise Refused(f"{repo / e['path']} is {size} bytes with sha256 {h.hexdigest()[:12]}…, the index "
                              f"says {e['size']} bytes, {e['sha256'][:12]}…: rebuild it or re-index the repository")
        for p in out.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(out, 0o755)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    kept = {INDEX, SIG} | {e["path"] for e in chosen}
    left = sorted(p.relative_to(repo).as_posix() for p in repo.rglob("*")
                  if not p.is_dir() and p.relative_to(repo).as_posix() not in kept)
    return [e["path"] for e in chosen], left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="where the image's packages go (must not exist)")
    ap.add_argument("repo", help="the repository directory (index.json and the packages it names)")
    ap.add_argument("names", nargs="*", help="only these packages (default: every package the index names)")
    a = ap.parse_args(argv)
    try:
        copied, left = bake(Path(a.repo), Path(a.out), a.names)
    except Refused as e:
        print(f"build-image: refusing --packages {a.repo}: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"build-image: cannot bake --packages {a.repo}: {e}", file=sys.stderr)
        return 2
    note = f"; left out {len(left)} file(s) the index does not name: {', '.join(left[:5])}" + (
        " …" if len(left) > 5 else "") if left else ""
    print(f"build-image: baked {len(copied)} package(s) and the index of {a.repo}{note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
