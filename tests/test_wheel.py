"""What users install must work: the wheel (`pip wheel --no-deps`), installed NON-editable into a fresh
venv made by the system's python3 (Debian 12: 3.11.2), run from outside the repository. Whatever a
command needs at run time must be in the wheel; a file of ours that is missing is a packaging bug, which
surfaces as driverd's "unexpected error" line: no command here may print one, or a traceback.

Smoke pass of the user-facing commands: demo, detect, plan, gpus, status, config, `kubectl driverd
--help` (the kubectl-driverd entry point on PATH), and daemon to READY=1 then SIGTERM (exit 0)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, require_binary

pytestmark = [pytest.mark.slow]

# The source tree as a clean checkout has it: no venv, no stale setuptools build/ (which would carry
# files deleted since into the wheel), no caches.
_PATTERNS = shutil.ignore_patterns(".git", ".venv", "*.egg-info", "__pycache__", ".pytest_cache", ".sandbox",
                                   ".whl", ".gl")


def _IGNORE(d: str, names: list[str]) -> set[str]:
    """The patterns anywhere; setuptools' build/ only at the top (driverd/build/ is a package of ours)."""
    return set(_PATTERNS(d, names)) | ({"build"} & set(names) if os.path.samefile(d, REPO) else set())


FORBIDDEN = ("unexpected error", "Traceback (most recent call last)")


def _system_python() -> str:
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    if os.environ.get("CI"):
        pytest.fail("CI runs on Debian: /usr/bin/python3 is missing")
    return sys.executable


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """{'bin': venv's bin directory, 'seconds': {step: wall time}}; the venv holds only the wheel and its
    dependencies."""
    base = tmp_path_factory.mktemp("wheel")
    times: dict[str, float] = {}
    t0 = time.monotonic()
    src = base / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE, symlinks=True)
    pip_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_USER")}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "-w", str(base / "dist"), str(src)], capture_output=True, text=True, timeout=600, env=pip_env)
    assert r.returncode == 0, r.stderr[-3000:]
    wheels = sorted((base / "dist").glob("driverd-*.whl"))
    assert len(wheels) == 1, wheels
    times["wheel"] = time.monotonic() - t0
    t0 = time.monotonic()
    venv = base / "venv"
    r = subprocess.run([_system_python(), "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    # --no-compile: byte-compiling every module of the dependencies (kubernetes: thousands) costs more
    # than the whole smoke pass; what runs is compiled on first import.
    r = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-compile", str(wheels[0])], capture_output=True, text=True, timeout=900, env=pip_env, cwd=base)
    assert r.returncode == 0, r.stderr[-3000:]
    times["venv+install"] = time.monotonic() - t0
    # Installed, not linked to the checkout: the package lives in the venv, no .pth points back here.
    r = subprocess.run([str(venv / "bin/python"), "-c", "import driverd, sys; print(driverd.__file__); "
                        "print(sys.version.split()[0])"], capture_output=True, text=True, cwd=base, env=_env(venv))
    where, version = r.stdout.split()
    assert where.startswith(str(venv)), where
    pths = [p for p in venv.rglob("*.pth") if str(REPO) in p.read_text(errors="replace")]
    assert pths == []
    print(f"\nwheel: built in {times['wheel']:.1f}s; venv (python {version}) + install in {times['venv+install']:.1f}s")
    return {"bin": venv / "bin", "base": base, "seconds": times, "wheel": wheels[0]}


def _env(venv_or_bin: Path, **extra: str) -> dict:
    bindir = venv_or_bin if venv_or_bin.name == "bin" else venv_or_bin / "bin"
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("DRIVERD_", "NOTIFY_", "WATCHDOG_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV", "KUBECONFIG")}
    e["PATH"] = f"{bindir}:{e.get('PATH', '/usr/bin:/bin')}"
    e.update(extra)
    return e


def _run(installed, *argv: str, ok: bool = True, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """A command of the installed driverd, run outside the repository (cwd: a temp dir)."""
    exe = argv[0] if argv[0].startswith("/") else str(installed["bin"] / argv[0])
    r = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout, cwd=installed["base"],
                       env=_env(installed["bin"], **env))
    out = r.stdout + r.stderr
    for bad in FORBIDDEN:
        assert bad not in out, f"{' '.join(argv)}: {bad!r} in its output (a file missing from the wheel?):\n{out[-3000:]}"
    if ok:
        assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{out[-3000:]}"
    return r


@pytest.fixture
def host(tmp_path):
    """A sample host tree (as the demo builds), with packages in a file:// repository and a config."""
    from driverd.sim.scenario import dgx_spec, make_host, make_packages
    root = make_host(tmp_path / "host", dgx_spec(gpus=2, nvswitches=0))
    make_packages(root / "srv/repo")
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[driver]\nversion = "535.261.03"\nflavor = "open"\n[packages]\nrepositories = ["file://{root}/srv/repo"]\n'
                   '[runtime]\nrestart = "none"\n'
                   '[modules]\nkernel = "sim"\n')      # a sample tree: the simulated kernel, asked for explicitly
    return root


def test_demo_runs_from_the_installed_wheel(installed, tmp_path):
    require_binary("depmod", "/usr/sbin/depmod", "/sbin/depmod")
    r = _run(installed, "driverd", "demo", "--workdir", str(tmp_path / "demo"), timeout=600)
    assert "== done in" in r.stdout
    # Its last stage, a rollout on a simulated cluster, needs a Kubernetes API server (--kubeconfig):
    # without one it says so in one line.
    cluster = [ln for ln in r.stdout.splitlines() if "rolling upgrade across a simulated cluster" in ln]
    assert len(cluster) == 1 and "skipped, it needs a Kubernetes API server" in cluster[0], r.stdout[-3000:]


def test_the_wheel_holds_no_test_api_server(installed):
    """The wheel (and so the image, built from it) carries the product only: no test API server, no
    OpenAPI documents, no jsonschema among its requirements (issue 19: test-only tools never ship)."""
    import zipfile
    with zipfile.ZipFile(installed["wheel"]) as z:
        names = z.namelist()
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert any(n.startswith("driverd/cluster/") for n in names)      # the product is there ...
    leaked = [n for n in names if "apiserver" in n or "openapi" in n or n.startswith("tests/")]
    assert not leaked, leaked[:5]                                    # ... its test API server is not
    runtime = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:") and "extra ==" not in ln]
    assert runtime and not [ln for ln in runtime if "jsonschema" in ln], runtime


def test_host_commands_from_the_installed_wheel(installed, host):
    import json
    r = _run(installed, "driverd", "detect", "--root", str(host), "--json", "--no-nvml")
    assert len(json.loads(r.stdout)["gpus"]) == 2
    r = _run(installed, "driverd", "plan", "--root", str(host), "--json")
    assert json.loads(r.stdout)["steps"]
    r = _run(installed, "driverd", "gpus", "--root", str(host))
    assert "H100" in r.stdout
    r = _run(installed, "driverd", "config", "--root", str(host))
    assert "535.261.03" in r.stdout
    r = _run(installed, "driverd", "status", "--root", str(host))
    assert "DIFFERS: driver 535.261.03 is wanted, none is loaded" in r.stdout


def test_kubectl_plugin_from_the_installed_wheel(installed):
    kubectl = require_binary("kubectl", "/usr/bin/kubectl")
    r = _run(installed, kubectl, "driverd", "--help")
    assert "rollout" in r.stdout
    assert shutil.which("kubectl-driverd", path=_env(installed["bin"])["PATH"]) == str(installed["bin"] / "kubectl-driverd")


def test_daemon_from_the_installed_wheel_goes_ready_and_stops_on_sigterm(installed, host):
    d = Path(tempfile.mkdtemp(prefix="whl-"))        # short: AF_UNIX paths are limited to 107 bytes
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(d / "notify"))
    sock.settimeout(120)
    proc = subprocess.Popen([str(installed["bin"] / "driverd"), "daemon", "--root", str(host), "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=installed["base"],
                            env=_env(installed["bin"], NOTIFY_SOCKET=str(d / "notify")))
    try:
        got, t0 = "", time.monotonic()
        while "READY=1" not in got:
            got += sock.recv(65536).decode() + "\n"
        ready = time.monotonic() - t0
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        for bad in FORBIDDEN:
            assert bad not in err, err[-3000:]
        assert "STOPPING=1" in got + sock.recv(65536).decode()
        print(f"\ninstalled daemon: READY=1 after {ready:.1f}s, exit 0 on SIGTERM")
    finally:
        sock.close()
        shutil.rmtree(d, ignore_errors=True)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_without_a_kubeconfig_skips_its_rollout_stage_in_one_line(capsys, tmp_path):
    """The demo never starts an API server of its own (a test API server is no part of the product):
    without --kubeconfig its last stage says why it is skipped, and the demo still succeeds."""
    import driverd.cli.demo as demo
    assert demo.cluster_demo(tmp_path / "cluster", 7, None) == 0
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert out == ["== 7. rolling upgrade across a simulated cluster: skipped, it needs a Kubernetes API server "
                   "(`driverd demo --kubeconfig FILE` with a throwaway test cluster's admin kubeconfig)"]
    assert not (tmp_path / "cluster").exists()
