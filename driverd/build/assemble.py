"""Turn built modules (+ firmware) into a package: copy into a staging tree, read each module's modinfo
fields from the file (driverd.package.modfields, no kmod needed), write the manifest, pack. Shared by `driverd build` (real kbuild output) and the simulated package set."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Sequence

from driverd.datatypes import dataclass
from driverd.errors import PackageError
from driverd.package.archive import PackageRef, file_entry, pack
from driverd.package.manifest import (FIRMWARE_DIR, MODULES_DIR, Manifest, ModuleInfo, Provenance)
from driverd.modinfo import module_name_from_file
from driverd.package.modfields import first, modinfo


@dataclass(frozen=True)
class PackageSpec:
    """The identity and provenance of a kernel-module package about to be assembled."""
    driver_version: str
    flavor: str
    kernel_release: str
    arch: str
    provenance: Provenance = Provenance()


def assemble(spec: PackageSpec, modules: Sequence[Path], firmware: Sequence[Path], out_dir: str | os.PathLike,
             level: int | None = None) -> PackageRef:
    if not modules:
        raise PackageError("no kernel modules to package", cause="the build produced no .ko files",
                           fix="check the build log")
    with tempfile.TemporaryDirectory(prefix="driverd-assemble.") as t:
        stage = Path(t)
        (stage / MODULES_DIR).mkdir()
        for m in modules:
            shutil.copyfile(m, stage / MODULES_DIR / m.name)
            os.chmod(stage / MODULES_DIR / m.name, 0o644)
        if firmware:
            (stage / FIRMWARE_DIR).mkdir()
            for fw in firmware:
                shutil.copyfile(fw, stage / FIRMWARE_DIR / fw.name)
                os.chmod(stage / FIRMWARE_DIR / fw.name, 0o644)
        staged = sorted((stage / MODULES_DIR).iterdir())
        info = modinfo(staged)
        mods: list[ModuleInfo] = []
        vermagics: set[str] = set()
        for p in staged:
            fields = info.get(os.path.realpath(p))
            if fields is None:
                raise PackageError(f"modinfo printed nothing for {p.name}", fix="check the module file")
            vm = first(fields, "vermagic")
            if vm:
                vermagics.add(vm)
            mods.append(ModuleInfo(
                name=first(fields, "name") or module_name_from_file(p), path=f"{MODULES_DIR}/{p.name}",
                version=first(fields, "version"), vermagic=vm, srcversion=first(fields, "srcversion"),
                depends=tuple(d for d in (first(fields, "depends") or "").split(",") if d),
                signer=first(fields, "signer"), sig_key=first(fields, "sig_key"),
                sig_hashalgo=first(fields, "sig_hashalgo"), firmware=tuple(fields.get("firmware", ()))))
        if len(vermagics) != 1:
            raise PackageError(f"modules disagree on vermagic: {sorted(vermagics) or 'none'}",
                               cause="they were not built against one kernel", fix="rebuild all modules together")
        vermagic = vermagics.pop()
        if not vermagic.split()[0] == spec.kernel_release:
            raise PackageError(f"modules were built for {vermagic.split()[0]}, not {spec.kernel_release}",
                               cause="the headers used belong to another kernel", fix="build with that kernel's headers")
        files = [file_entry(p, f"{MODULES_DIR}/{p.name}") for p in staged]
        if firmware:
            files += [file_entry(p, f"{FIRMWARE_DIR}/{p.name}") for p in sorted((stage / FIRMWARE_DIR).iterdir())]
        manifest = Manifest(driver_version=spec.driver_version, flavor=spec.flavor,
                            kernel_release=spec.kernel_release, vermagic=vermagic, arch=spec.arch,
                            files=tuple(files), modules=tuple(mods), provenance=spec.provenance)
        return pack(stage, manifest, out_dir, **({"level": level} if level is not None else {}))
