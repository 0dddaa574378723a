"""Ctrl-C (or SIGTERM) in `driverd demo` stops the demo (issue 32, item 6): it used to be reported as
"exit 130 as expected" at the upgrade stage, and the demo carried on."""
from __future__ import annotations

import os
import signal

import pytest

from driverd.apply import executor
from driverd.cli.demo import run_demo


@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143)])
def test_interrupting_a_stage_stops_the_demo(tmp_path, monkeypatch, capsys, how, code):
    for k in [k for k in os.environ if k.startswith("DRIVERD_")]:
        monkeypatch.setenv(k, os.environ[k])            # the demo clears them; given back afterwards
    real = executor.Executor._step

    def step(self, doc, s):
        if doc["command"].startswith("reload"):         # the upgrade stage, inside one of its steps
            if how == "ctrl-c":
                raise KeyboardInterrupt                 # what Python makes of the terminal's SIGINT
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, doc, s)
    monkeypatch.setattr(executor.Executor, "_step", step)
    before = signal.getsignal(signal.SIGTERM)
    rc = run_demo(str(tmp_path / "wd"))
    out, err = capsys.readouterr()
    assert rc == code
    # the reload is stage 6 (after apply, status and the upgrade that switches both halves)
    assert "as expected" not in out and "== 7." not in out and "== done" not in out
    assert f"demo: stopped at stage 6 (reload); the sandbox stays in {tmp_path / 'wd'}" in out
    assert err.strip().splitlines()[-1] == ("driverd: interrupted" if code == 130 else "driverd: terminated")
    assert signal.getsignal(signal.SIGTERM) == before          # the demo's handler is gone again
