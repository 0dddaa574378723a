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


def test_the_child_imports_only_what_the_report_needs():
    """Issue 47: detect asks NVML in a child on another core; what that child imports is its whole
    cost, so it must not pull in the facts' classes (dataclasses), typing or driverd's other modules."""
    import json
    import subprocess

    from driverd.runner import CHILD_CWD, python_child
    argv = python_child("driverd.host.nvml", site_modules=("pynvml",))
    # the same child, asked which modules it holds once its report is printed
    argv[argv.index("-c") + 1] += "; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(argv, capture_output=True, text=True, cwd=CHILD_CWD, check=True).stdout.splitlines()
    report, modules = json.loads(out[0]), set(json.loads(out[1]))
    assert "available" in report and "reason" in report
    heavy = {"dataclasses", "typing", "inspect", "pathlib", "driverd.host.facts", "driverd.root", "site"}
    assert not heavy & modules, heavy & modules
    assert {m for m in modules if m.startswith("driverd")} <= {"driverd", "driverd.host", "driverd.host.nvml"}
