import shutil
import subprocess

from tests.conftest import REPO, require_binary


def test_units_verify_with_systemd_analyze(tmp_path):
    """systemd-analyze verify, which also runs `man` for every Documentation=man: page: found among the
    pages driverd ships (man/), installed where README's Install puts them."""
    import os
    analyze = require_binary("systemd-analyze")
    manroot = tmp_path / "share" / "man"
    for page in (REPO / "man").iterdir():
        dest = manroot / f"man{page.suffix[1:]}" / page.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(page, dest)
    env = dict(os.environ, MANPATH=f"{manroot}:")
    for unit in (REPO / "systemd").glob("*.service"):
        text = unit.read_text()
        assert "ExecStart=/usr/local/bin/driverd " in text
        # verify checks that ExecStart exists; point it at a real executable for the check
        copy = tmp_path / unit.name
        copy.write_text(text.replace("/usr/local/bin/driverd", shutil.which("true")))
        res = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, env=env)
        problems = [ln for ln in res.stderr.splitlines() if unit.name in ln or "driverd" in ln]
        assert res.returncode == 0 and not problems, res.stderr
