"""The daemon asks NVML in a short-lived child process (libnvidia-ml keeps ~20 MB resident after
nvmlShutdown for the life of the process that loaded it): the child's report is the in-process one."""
from driverd.host import nvml
from driverd.root import Root


def test_child_report_equals_in_process_report():
    direct = nvml.read_nvml(Root("/"), True)
    nvml.query_in_child(True)
    try:
        child = nvml.read_nvml(Root("/"), True)
    finally:
        nvml.query_in_child(False)
    # On a machine without a GPU both say why NVML is unavailable, in the same words; on a GPU host
    # both list the same devices.
    assert (child.available, child.reason, child.devices) == (direct.available, direct.reason, direct.devices)
    assert "query process failed" not in (child.reason or "")


def test_captured_tree_is_never_asked_in_a_child(tmp_path):
    nvml.query_in_child(True)
    try:
        f = nvml.read_nvml(Root(str(tmp_path)), True)
    finally:
        nvml.query_in_child(False)
    assert not f.available and "not the live host" in f.reason
