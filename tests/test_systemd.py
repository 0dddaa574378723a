import shutil
import subprocess

from tests.conftest import REPO, require_binary


def test_units_verify_with_systemd_analyze(tmp_path):
    analyze = require_binary("systemd-analyze")
    for unit in (REPO / "systemd").glob("*.service"):
        text = unit.read_text()
        assert "ExecStart=/usr/local/bin/driverd " in text
        # verify checks that ExecStart exists; point it at a real executable for the check
        copy = tmp_path / unit.name
        copy.write_text(text.replace("/usr/local/bin/driverd", shutil.which("true")))
        res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True)
        problems = [ln for ln in res.stderr.splitlines() if unit.name in ln or "driverd" in ln]
        assert res.returncode == 0 and not problems, res.stderr
