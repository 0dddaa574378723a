"""Reading module metadata with the real `modinfo` (one run for all files) and parsing its output."""
from __future__ import annotations

import os
from typing import Sequence

from driverd.errors import PackageError
from driverd.runner import Runner, which

SINGLE_FIELDS = ("name", "version", "vermagic", "srcversion", "signer", "sig_key", "sig_hashalgo")


def parse_modinfo(text: str) -> list[dict[str, list[str]]]:
    """Split `modinfo a.ko b.ko` output into one dict per file: field -> values (in order).

    Continuation lines (the signature's hex dump) start with a tab and belong to the previous field.
    """
    out: list[dict[str, list[str]]] = []
    cur: dict[str, list[str]] | None = None
    last: str | None = None
    for line in text.splitlines():
        if line.startswith(("\t", " ")) and cur is not None and last is not None:
            cur[last][-1] += line.strip()
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "filename":
            cur = {}
            out.append(cur)
        if cur is None:
            cur = {}
            out.append(cur)
        cur.setdefault(key, []).append(value)
        last = key
    return out


def modinfo(paths: Sequence[str | os.PathLike], runner: Runner | None = None) -> dict[str, dict[str, list[str]]]:
    """filename -> fields for every module, from one `modinfo` run."""
    runner = runner or Runner()
    exe = which("modinfo")
    if exe is None:
        raise PackageError("modinfo is not installed", cause="kmod is missing", fix="install kmod")
    if not paths:
        return {}
    res = runner.run([exe, *map(os.fspath, paths)], timeout=60, check=False, mutates=False)
    if not res.ok:
        raise PackageError(f"modinfo could not read a module: {res.first_error_line()}",
                           cause="a .ko file is damaged or not a kernel module", fix="rebuild the package")
    parsed = parse_modinfo(res.stdout)
    return {os.path.realpath(p["filename"][0]): p for p in parsed if p.get("filename")}


def first(fields: dict[str, list[str]], key: str) -> str | None:
    v = fields.get(key)
    return v[0] if v else None


def module_name_from_file(path: str | os.PathLike) -> str:
    from driverd.kmod.modinfo import module_name
    return module_name(os.fspath(path))
