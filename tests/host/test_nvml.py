import json

from driverd.host.nvml import CAPTURE_PATH, read_nvml
from driverd.root import Root


def test_not_live_root_says_why(tmp_path):
    n = read_nvml(Root(tmp_path), driver_loaded=True)
    assert not n.available and "not the live host" in n.reason


def test_captured_report_and_garbled(tmp_path):
    p = tmp_path / CAPTURE_PATH.lstrip("/")
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"available": True, "reason": None, "driver_version": "580.159.04", "devices": [
        {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1", "pci_bus_id": "00000000:00:06.0",
         "memory_total_mib": 143771, "persistence_mode": True, "mig_mode_current": False, "mig_mode_pending": False}]}))
    n = read_nvml(Root(tmp_path), driver_loaded=True)
    assert n.available and n.source == "capture" and n.devices[0].memory_total_mib == 143771
    p.write_text("{broken")
    n = read_nvml(Root(tmp_path), driver_loaded=True)
    assert not n.available and "garbled" in n.reason


def test_live_host_without_driver():
    n = read_nvml(Root("/"), driver_loaded=False)
    assert not n.available and n.reason == "the NVIDIA driver is not loaded"


def test_the_nvml_child_imports_nothing_from_the_callers_directory(tmp_path, monkeypatch):
    """Issue 44, item 4: the daemon (root) asks NVML in a child; a json.py planted where the daemon was
    started, or on a PYTHONPATH in its environment, is never imported by that child."""
    from driverd.host import nvml
    marker = tmp_path / "imported-as-root"
    planted = tmp_path / "users-dir"
    planted.mkdir()
    (planted / "json.py").write_text(f"open({str(marker)!r}, 'a').write('json')\n")
    monkeypatch.chdir(planted)
    monkeypatch.setenv("PYTHONPATH", str(planted))
    monkeypatch.setattr(nvml, "_in_child", True)
    n = read_nvml(Root("/"), driver_loaded=True)
    assert not marker.exists()
    # the child ran and answered in its own words (no GPU driver on a test machine)
    assert "the NVML query process failed" not in (n.reason or ""), n.reason
