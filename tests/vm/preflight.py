"""Runs INSIDE the VM guest: driverd's signer preflight on one package (or one of the kernel's own
modules), against the guest kernel's keyrings and enforcement, printed as JSON. The guest test then
loads the same nvidia.ko with insmod and compares the kernel's verdict with this one.

    python tests/vm/preflight.py PACKAGE.tar.zst     # also extracts nvidia.ko to /tmp for the insmod
    python tests/vm/preflight.py --module dummy      # a module of the running kernel's tree
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

from driverd.host.kernel import read_kernel
from driverd.host.keyrings import read_keyrings
from driverd.build import signers
from driverd.package.modsig import read_signature
from driverd.root import Root


def main() -> int:
    root = Root("/")
    keyrings = read_keyrings(root)
    kernel = read_kernel(root, [])
    if sys.argv[1] == "--module":
        path = subprocess.run(["modinfo", "-n", sys.argv[2]], capture_output=True, text=True).stdout.strip()
        sigs, source = [read_signature(path)], path
    else:
        pkg = sys.argv[1]
        sigs, source = signers.package_signatures(pkg), pkg
        dest = "/tmp/preflight-" + os.path.basename(pkg).split(".tar")[0][:60]
        os.makedirs(dest, exist_ok=True)
        with tarfile.open(pkg, "r:*") if not pkg.endswith(".zst") else _zst(pkg) as tar:
            for ti in tar:
                if ti.isreg() and ti.name.endswith("/nvidia.ko"):
                    with open(os.path.join(dest, "nvidia.ko"), "wb") as f:
                        f.write(tar.extractfile(ti).read())
        path = os.path.join(dest, "nvidia.ko")
    v = signers.judge(sigs, keyrings, [], enforced=kernel.module_signature_enforced, source=source)
    nv = next((m for m in v.modules if os.path.basename(m.module).split(".ko")[0] in ("nvidia", "dummy")), None)
    print(json.dumps({"status": v.status, "blocks": v.blocks, "summary": v.summary, "enforced": v.enforced,
                      "module_status": nv.status if nv else None, "nvidia_path": path,
                      "sources": list(kernel.signature_enforcement_sources)}))
    return 0


def _zst(pkg: str):
    from driverd.package.archive import _open_stream
    return _open_stream(pkg)


if __name__ == "__main__":
    sys.exit(main())
