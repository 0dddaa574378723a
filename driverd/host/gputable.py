"""The GPU table shipped in driverd/data/gpus.json: device id -> product, architecture, open-module
support and driver-branch range. Unknown ids are reported as `unknown`, never guessed."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

ARCH_ORDER = ("Kepler", "Maxwell", "Pascal", "Volta", "Turing", "Ampere", "Ada Lovelace", "Hopper", "Blackwell")
OPEN_SUPPORT = ("required", "supported", "unsupported")


@dataclass(frozen=True)
class GpuModel:
    device_id: str
    name: str
    architecture: str
    chip: str | None
    open_module_support: str
    min_branch: int | None
    last_branch: int | None


@lru_cache(maxsize=1)
def table() -> dict:
    with resources.files("driverd.data").joinpath("gpus.json").open("rb") as f:
        return json.load(f)


def norm_id(device_id: str) -> str:
    return "0x" + device_id.lower().removeprefix("0x").rjust(4, "0")


def lookup(device_id: str) -> GpuModel | None:
    t = table()
    did = norm_id(device_id)
    dev = t["devices"].get(did)
    if dev is None:
        return None
    arch = t["architectures"][dev["architecture"]]
    return GpuModel(
        device_id=did, name=dev["name"], architecture=dev["architecture"], chip=dev.get("chip"),
        open_module_support=dev.get("open_module_support", arch["open_module_support"]),
        min_branch=dev.get("min_branch", arch.get("min_branch")),
        last_branch=dev.get("last_branch", arch.get("last_branch")))


def nvswitch_name(device_id: str) -> str | None:
    sw = table().get("nvswitches", {}).get(norm_id(device_id))
    return sw["name"] if sw else None
