"""GPUDirect RDMA facts: can this kernel load nvidia-peermem?

nvidia-peermem registers with the peer-memory API of MLNX_OFED's (or DOCA-OFED's) ib_core:
`ib_register_peer_memory_client`. Inbox (kernel.org / distribution) ib_core has no such symbol, so
there `modprobe nvidia-peermem` fails with "Unknown symbol ib_register_peer_memory_client"; with
the open modules on kernel >= 5.12 GPUDirect RDMA uses DMA-BUF instead and needs no extra module
(NVIDIA's GPUDirect RDMA and open-modules documentation). Evidence, strongest first:

- /proc/kallsyms lists `ib_register_peer_memory_client [ib_core]` while ib_core is loaded (and
  does not list it when the loaded ib_core is the inbox one);
- the ib_core module file modprobe would load for the running kernel (modules.dep): MLNX_OFED
  installs it under updates/ (DKMS: updates/dkms/) or extra/mlnx-ofa_kernel/; inbox is kernel/;
- MLNX_OFED's `ofed_info` script (/usr/bin/ofed_info) and its version string; the DKMS tree of
  mlnx-ofed-kernel.

Read-only, never raises: absence is a fact.
"""
from __future__ import annotations

import re

from driverd.datatypes import dataclass
from driverd.root import Root

SYMBOL = "ib_register_peer_memory_client"
KO_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")
OFED_INFO = ("/usr/bin/ofed_info", "/usr/sbin/ofed_info")
_OFED_VERSION = re.compile(r"\b((?:MLNX_OFED_LINUX|OFED-internal|DOCA[-_]OFED|MLNX_EN)[-_][0-9][\w.-]*?)(?=[:\s\"']|$)")
KALLSYMS_LIMIT = 128 << 20


@dataclass(frozen=True)
class RdmaFacts:
    """Whether nvidia-peermem can load: ib_core, MLNX_OFED and its peer-memory API."""
    ib_core_loaded: bool
    ib_core_path: str | None          # the module file modprobe would load (host path), None when absent
    ib_core_source: str               # mlnx-ofed | inbox | absent
    ofed_version: str | None          # "MLNX_OFED_LINUX-24.10-1.1.4.0" from ofed_info
    ofed_evidence: tuple[str, ...]    # what says MLNX_OFED is installed
    peer_memory_symbol: bool | None   # the symbol in /proc/kallsyms; None when ib_core is not loaded / unreadable
    peer_memory_api: bool | None      # the conclusion: can nvidia-peermem resolve its symbols? None: unknown
    evidence: str                     # one line: why peer_memory_api is what it is


def _ib_core_from_modules_dep(root: Root, release: str) -> str | None:
    text = root.read_text(f"/lib/modules/{release}/modules.dep", 32 << 20)
    for line in (text or "").splitlines():
        path = line.split(":", 1)[0]
        if path.rsplit("/", 1)[-1] in tuple("ib_core" + s for s in KO_SUFFIXES):
            return path if path.startswith("/") else f"/lib/modules/{release}/{path}"
    return None


def _find(root: Root, base: str, depth: int = 6) -> str | None:
    """The first ib_core module file under `base` (host path), breadth-first, bounded."""
    level = [base]
    for _ in range(depth):
        nxt = []
        for d in level:
            for n in root.listdir(d):
                p = f"{d}/{n}"
                if n in tuple("ib_core" + s for s in KO_SUFFIXES) and root.is_file(p):
                    return p
                if root.is_dir(p) and not root.readlink(p):
                    nxt.append(p)
        level = sorted(nxt)
    return None


def ib_core_file(root: Root, release: str | None) -> str | None:
    if not release:
        return None
    got = _ib_core_from_modules_dep(root, release)
    if got:
        return got
    base = f"/lib/modules/{release}"
    for sub in ("updates", "extra", "kernel/drivers/infiniband", "kernel"):   # depmod's default priority
        got = _find(root, f"{base}/{sub}")
        if got:
            return got
    return None


def _source(path: str | None, release: str) -> str:
    if path is None:
        return "absent"
    rel = path.removeprefix(f"/lib/modules/{release}/")
    return "mlnx-ofed" if rel.startswith(("updates/", "extra/")) else "inbox"


def kallsyms_has(root: Root, symbol: str) -> bool | None:
    """Whether /proc/kallsyms names `symbol` (streamed: the file is tens of MB on a real host)."""
    real = root.safe_on_disk("/proc/kallsyms")
    if real is None:
        return None
    want = f" {symbol}"
    try:
        with open(real, "rb") as f:
            seen = 0
            for raw in f:
                seen += len(raw)
                line = raw.decode("ascii", "replace").rstrip("\n")
                name = line.split("\t", 1)[0]
                if name.endswith(want):
                    return True
                if seen > KALLSYMS_LIMIT:
                    return None
    except OSError:
        return None
    return False


def ofed_info_version(root: Root) -> tuple[str | None, str | None]:
    for p in OFED_INFO:
        text = root.read_text(p, 1 << 20)
        if text is None:
            continue
        m = _OFED_VERSION.search(text)
        return (m.group(1) if m else None), p
    return None, None


def read_rdma(root: Root, release: str | None, loaded_modules: dict) -> RdmaFacts:
    loaded = "ib_core" in loaded_modules or root.read_first_line("/sys/module/ib_core/initstate") == "live"
    path = ib_core_file(root, release)
    source = _source(path, release or "")
    version, info_path = ofed_info_version(root)
    evidence: list[str] = []
    if source == "mlnx-ofed":
        evidence.append(f"ib_core is {path}")
    if info_path:
        evidence.append(f"{info_path}" + (f" ({version})" if version else ""))
    if root.is_dir("/var/lib/dkms/mlnx-ofed-kernel"):
        evidence.append("/var/lib/dkms/mlnx-ofed-kernel")
    symbol = kallsyms_has(root, SYMBOL) if loaded else None
    if symbol is True:
        api, why = True, f"the loaded ib_core exports {SYMBOL} (/proc/kallsyms)"
    elif symbol is False:
        api, why = False, (f"the loaded ib_core has no {SYMBOL} (/proc/kallsyms): it is the kernel's inbox "
                           "module, not MLNX_OFED's")
    elif source == "mlnx-ofed":
        api, why = True, f"MLNX_OFED's ib_core ({path}) is the one modprobe loads; it carries {SYMBOL}"
    elif source == "inbox":
        api, why = False, (f"ib_core is the kernel's inbox module ({path}), which has no {SYMBOL}"
                           + ("; ofed_info exists but MLNX_OFED's modules are not installed for this kernel"
                              if info_path else ""))
    else:
        api, why = None, "no ib_core module for the running kernel" + (" (ofed_info exists)" if info_path else "")
    return RdmaFacts(ib_core_loaded=loaded, ib_core_path=path, ib_core_source=source, ofed_version=version,
                     ofed_evidence=tuple(evidence), peer_memory_symbol=symbol, peer_memory_api=api, evidence=why)
