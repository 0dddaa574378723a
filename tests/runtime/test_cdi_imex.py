"""IMEX channels in the CDI spec (driverd.runtime.cdi): on a GB200 tray each
/dev/nvidia-caps-imex-channels/channel<N> is a device of its own, in the device-node shape nvidia-ctk's imex
mode writes (pkg/nvcdi/lib-imex.go: path and hostPath), asked for beside the GPUs and never part of `all`."""
from __future__ import annotations

import yaml

from driverd.root import Root
from driverd.runtime import Options, cdi
from driverd.sim.hosttree import write_host
from driverd.sim.scenario import dgx_spec, gb200_spec
from tests.runtime.driver_trees import add_gpus

CH = "/dev/nvidia-caps-imex-channels"


def _devices(spec) -> dict[str, list[dict]]:
    return {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}


def test_the_gb200_spec_carries_the_channel(tmp_path):
    write_host(tmp_path, gb200_spec("580.95.05"))
    spec, notes = cdi.build_with_notes(Root(tmp_path))
    assert cdi.validate(yaml.safe_load(cdi.render(spec))) == []
    dev = _devices(spec)
    assert dev["imex-channel0"] == [{"path": f"{CH}/channel0", "hostPath": f"{CH}/channel0"}]
    # the four GPUs by minor and UUID, then the channel, then `all` — which is the GPUs alone
    assert [d["name"] for d in spec["devices"]][:2] == ["0", "GPU-6b2d6ad4-55e3-4f6c-9a1e-000000000000"]
    assert [d["name"] for d in spec["devices"]][-2:] == ["imex-channel0", "all"]
    assert dev["all"] == [{"path": f"/dev/nvidia{i}"} for i in range(4)]
    assert not any("imex" in n["path"] for n in spec["containerEdits"].get("deviceNodes", []))
    assert any("IMEX channels: imex-channel0" in n and "nvidia.com/gpu=imex-channel0" in n for n in notes)


def test_every_channel_by_number_and_nothing_else(tmp_path):
    write_host(tmp_path, gb200_spec("580.95.05"))
    d = tmp_path / CH.lstrip("/")
    for name in ("channel10", "channel2", "channelx", "channel-1", "readme"):
        (d / name).write_text("")
    (d / "channel3").mkdir()
    spec = cdi.build(Root(tmp_path))
    names = [x["name"] for x in spec["devices"] if x["name"].startswith("imex")]
    assert names == ["imex-channel0", "imex-channel2", "imex-channel10"]
    assert cdi.validate(spec) == []


def test_no_channel_no_imex_device(tmp_path):
    write_host(tmp_path, dgx_spec())
    add_gpus(tmp_path, 2, char_devices=False)
    spec, notes = cdi.build_with_notes(Root(tmp_path))
    assert not [x for x in spec["devices"] if "imex" in x["name"]] and not [n for n in notes if "IMEX" in n]


def test_refresh_writes_the_channel_into_the_spec_file(tmp_path):
    write_host(tmp_path, gb200_spec("580.95.05"))
    report = cdi.refresh(Root(tmp_path), Options(cdi=True, restart="none", state_dir="/var/lib/driverd"))
    written = yaml.safe_load((tmp_path / "var/run/cdi/nvidia.yaml").read_text())
    assert _devices(written)["imex-channel0"][0]["path"] == f"{CH}/channel0"
    assert report.files_changed and any("imex-channel0" in n for n in report.notes)
