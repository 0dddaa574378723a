"""Real driverd packages made of simulated modules (driverd.sim.fakemod): the five NVIDIA modules
with their real dependency graph, real modinfo fields, optionally signed by the real sign-file.
Tests and the demo use these in place of a 2-minute compile."""
from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from driverd.package.archive import PackageRef
from driverd.build.assemble import PackageSpec, assemble
from driverd.package.manifest import Provenance
from driverd.sim.fakemod import DEFAULT_RELEASE, DEFAULT_VERSION, Signer, write_nvidia_build


def make_fake_package(out_dir: str | os.PathLike, version: str = DEFAULT_VERSION, release: str = DEFAULT_RELEASE,
                      *, flavor: str = "open", arch: str = "x86_64", vermagic: str | None = None,
                      signer: Signer | None = None, text_size: int = 64,
                      with_firmware: bool = True) -> PackageRef:
    with tempfile.TemporaryDirectory(prefix="driverd-fakepkg.") as t:
        b = write_nvidia_build(t, version, release, flavor=flavor, arch=arch, vermagic=vermagic, sign=signer,
                               text_size=text_size, with_firmware=with_firmware)
        spec = PackageSpec(version, flavor, release, arch,
                           Provenance(source="driverd.sim.fakemod", source_sha256=None, compiler="none (simulated)",
                                      built_at=datetime(2025, 1, 1, tzinfo=timezone.utc).isoformat(),
                                      builder="driverd.sim.fakepkg"))
        return assemble(spec, b.modules, b.firmware, Path(out_dir))
