"""--log-format json|text (and log.format / $DRIVERD_LOG_FORMAT): one JSON object a line on stderr
with time, level, msg and fields (step, run_id, command, node, reason, state...), for one-shot
commands and the daemon; text stays the default and results stay on stdout."""
from __future__ import annotations

import io
import json
import re

from driverd import log
from tests.apply.conftest import drv
from tests.daemon.conftest import OLD, daemons, write_config  # noqa: F401  (fixture)
from tests.kmod.conftest import host, packages  # noqa: F401  (fixtures)

TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def _events(stderr: str) -> list[dict]:
    out = []
    for line in stderr.splitlines():
        ev = json.loads(line)               # every line is one object
        assert TIME.match(ev["time"]) and ev["level"] in ("debug", "info", "warning", "error") and ev["msg"]
        out.append(ev)
    return out


def test_one_shot_command_logs_json_with_step_fields(host, packages):
    write_config(host, OLD, packages["old"].parent)
    r = drv(host, "--log-format", "json", "apply", env={"NODE_NAME": "gpu-node-7"})
    assert r.returncode == 0, r.stderr
    evs = _events(r.stderr)
    steps = [e for e in evs if e.get("step")]
    assert {"load-modules", "validate"} <= {e["step"] for e in steps}
    assert all(e["command"] == "apply" and e["run_id"] and e["node"] == "gpu-node-7" for e in steps)
    load = next(e for e in steps if e["step"] == "load-modules")
    assert load["msg"].startswith(f"> load the NVIDIA modules ({OLD}") and load["level"] == "info"
    assert "apply: done" in r.stdout                # the result stays human text on stdout


def test_text_is_the_default_and_the_flag_beats_the_config(host, packages):
    write_config(host, OLD, packages["old"].parent)
    r = drv(host, "apply", "--dry-run")
    assert r.returncode == 0 and r.stderr and not r.stderr.lstrip().startswith("{")
    write_config(host, OLD, packages["old"].parent, extra='[log]\nformat = "json"\n')
    r = drv(host, "apply", "--dry-run")
    assert _events(r.stderr)                         # log.format from the config file
    r = drv(host, "apply", "--dry-run", "--log-format", "text")
    assert not r.stderr.lstrip().startswith("{")     # the command line wins
    write_config(host, OLD, packages["old"].parent)
    r = drv(host, "apply", "--dry-run", env={"DRIVERD_LOG_FORMAT": "json"})
    assert _events(r.stderr)


def test_errors_and_warnings_are_events(host, packages, tmp_path):
    r = drv(host, "--log-format", "json", "reload", "--package", str(tmp_path / "nope.tar.zst"))
    assert r.returncode != 0
    (ev,) = [e for e in _events(r.stderr) if e["level"] == "error"]
    assert ev["exit_code"] == r.returncode and ev["msg"] and "error" in ev
    bad = tmp_path / "bad"
    bad.mkdir()
    r = drv(bad, "detect", "--log-format", "json")
    (ev,) = [e for e in _events(r.stderr) if e["level"] == "error"]
    assert r.returncode == 2 and "is not a host's root" in ev["msg"] and ev["exit_code"] == 2
    r = drv(host, "status", "--kernel", "sim", "--log-format", "json")      # a deprecated spelling: a warning
    warn = [e for e in _events(r.stderr) if e["level"] == "warning"]
    assert warn and "--kernel is deprecated" in warn[0]["msg"] and not warn[0]["msg"].startswith("driverd")


def test_daemon_logs_json_with_state_and_reason(host, packages, daemons):
    write_config(host, OLD, packages["old"].parent, extra='[log]\nformat = "json"\n')
    d = daemons(host, env={"NODE_NAME": "gpu-node-7"})
    d.wait_notify("READY=1", 60)
    d.wait_log(r'"msg": "converged: ', 10)
    assert d.stop()[0] == 0
    evs = _events(d.log)
    conv = next(e for e in evs if e["msg"].startswith("converged: "))
    assert conv["state"] == "converged" and OLD in conv["reason"] and conv["component"] == "daemon"
    assert conv["mode"] == "daemon" and conv["node"] == "gpu-node-7" and conv["seconds"] >= 0
    assert any(e.get("step") == "load-modules" for e in evs)
    assert any(e["msg"].startswith("listening on 127.0.0.1:") and e["listen"] for e in evs)


def test_record_fields_and_levels():
    buf = io.StringIO()
    log.reset()
    try:
        log.configure("json", stream=buf, node="n1")
        with log.fields(step="unload-modules", run_id="r1"):
            log.log("  ! unload modules failed: busy")
            log.log("driverd: warning: the journal was damaged")
        log.log("driverd daemon: ready", reason="x")
        log.configure("text")                  # not pinned: a config may switch it
        log.log("plain line")
        log.configure("json", pin=True)
        log.configure("text")                  # pinned by the command line: kept
        log.log("still json")
    finally:
        log.reset()
    lines = buf.getvalue().splitlines()
    a, b, c = (json.loads(x) for x in lines[:3])
    assert a["level"] == "error" and a["step"] == "unload-modules" and a["node"] == "n1" and a["msg"].startswith("! ")
    assert b["level"] == "warning" and b["msg"] == "the journal was damaged" and b["run_id"] == "r1"
    assert c["component"] == "daemon" and c["msg"] == "ready" and "step" not in c and c["reason"] == "x"
    assert lines[3] == "plain line" and json.loads(lines[4])["msg"] == "still json"


def test_build_matrix_progress_is_one_event_per_cell(tmp_path):
    from tests.conftest import REPO, run_cli
    r = run_cli("--log-format", "json", "build-matrix", str(REPO / "kernels/debian-bookworm.toml"),
                "--out", str(tmp_path / "repo"), "--dry-run")
    assert r.returncode == 0, r.stderr
    evs = _events(r.stderr)
    assert sorted(e["cell"] for e in evs) == sorted(c for c in (
        f"535.261.03-{f}-6.1.0-{n}-cloud-amd64-x86_64" for f in ("open", "proprietary") for n in (47, 56)))
    assert all(e["status"] == "would-build" and e["progress"].endswith("/4") for e in evs)


# -- issue 32, item 9 --------------------------------------------------------------------------------

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


def test_daemon_text_lines_carry_their_time(host, packages, daemons):
    write_config(host, OLD, packages["old"].parent)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    d.wait_log(r"converged: ", 10)
    assert d.stop()[0] == 0
    lines = [ln for ln in d.lines if ln.strip()]
    assert lines and all(STAMP.match(ln) for ln in lines), lines[:5]
    r = drv(host, "status")                     # a one-shot command's lines stay the message alone
    assert not any(STAMP.match(ln) for ln in r.stderr.splitlines() + r.stdout.splitlines())


def test_no_second_time_where_the_journal_stamps_lines(monkeypatch):
    """systemd sets $JOURNAL_STREAM to the dev:inode of the stream it connected to stderr (systemd.exec(5))."""
    import os
    st = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
    assert log.stderr_is_journal()
    monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")      # inherited, stderr elsewhere
    assert not log.stderr_is_journal()
    buf = io.StringIO()
    log.reset()
    try:
        log.configure(stream=buf, timestamps=True)
        log.log("converged")
        log.configure(timestamps=False)
        log.log("converged")
    finally:
        log.reset()
    a, b = buf.getvalue().splitlines()
    assert STAMP.match(a) and a.endswith(" converged") and b == "converged"


def test_kernel_log_lines_follow_the_error_one_each(host, packages):
    """A failed load quotes the kernel's lines under the one-line error (text), as a list (JSON): never
    " | "-joined into one line hundreds of characters long."""
    assert drv(host, "load").returncode == 0
    r = drv(host, "reload", "--package", str(packages["broken"]))
    assert r.returncode == 3, r.stderr
    lines = r.stderr.splitlines()
    err = next(i for i, ln in enumerate(lines) if ln.startswith("driverd: error: reload failed at load-modules"))
    assert " | " not in lines[err] and "NVRM" not in lines[err] and len(lines[err]) < 500
    quoted = lines[err + 1:]
    assert quoted and all(ln.startswith("    [") for ln in quoted), quoted
    assert any("RmInitAdapter failed" in ln for ln in quoted)
    step = next(i for i, ln in enumerate(lines) if ln.startswith("  ! load the NVIDIA modules"))
    assert lines[step + 1].startswith("    [") and " | " not in lines[step]
    assert drv(host, "load").returncode == 0
    r = drv(host, "reload", "--package", str(packages["broken"]), "--json", "--log-format", "json")
    assert r.returncode == 3
    docs, at, dec = [], 0, json.JSONDecoder()
    while r.stdout[at:].strip():                    # the run's result, then the error
        at += len(r.stdout[at:]) - len(r.stdout[at:].lstrip())
        doc, at = dec.raw_decode(r.stdout, at)
        docs.append(doc)
    out = docs[-1]
    assert isinstance(out["details"]["kernel_log"], list) and any("NVRM" in x for x in out["details"]["kernel_log"])
    evs = _events(r.stderr)
    final = next(e for e in evs if e["level"] == "error" and e.get("exit_code") == 3)
    assert final["kernel_log"] == out["details"]["kernel_log"] and "\n" not in final["msg"]
    failed = next(e for e in evs if e.get("step") == "load-modules" and e.get("status") == "failed")
    assert any("NVRM" in x for x in failed["kernel_log"])
