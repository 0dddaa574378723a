"""The console script end to end, on captured real hosts and synthetic trees."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from driverd.sim.hosttree import HostSpec, Pci, h100, write_host

H200 = "h200-ubuntu-fc-580-open.tar.gz"     # captured on a real H200 host, open driver 580 loaded
NOGPU = "debian12-nogpu.tar.gz"             # captured on a Debian 12 VM without a GPU
A_REPO = {"DRIVERD_PACKAGES_REPOSITORIES": "file:///srv/driverd"}   # somewhere a package may come from


def test_detect_json_contract_on_real_gpu_host(unpack_host):
    root = unpack_host(H200)
    res = run_cli("detect", "--root", str(root), "--json", check=True)
    d = json.loads(res.stdout)
    assert d["kernel"]["release"] == "6.18.44-fc-v657-gpu"
    assert d["kernel"]["module_signature_enforced"] is True
    assert d["kernel"]["module_unload_supported"] is False
    assert (d["os"]["id"], d["os"]["version_id"]) == ("ubuntu", "24.04")
    [g] = d["gpus"]
    assert (g["pci_address"], g["device_id"], g["architecture"], g["bound_driver"]) == \
        ("0000:00:06.0", "0x2335", "Hopper", "nvidia")
    assert g["name"] == "NVIDIA H200" and g["open_module_support"] == "supported"    # NVIDIA's own list names it so
    assert g["uuid"] == "GPU-6c1236f9-25a3-ea90-6fdc-40acd725cefd" and g["minor"] == 0
    assert d["nvswitches"] == [] and d["nouveau"]["loaded"] is False and d["nouveau"]["blacklisted"] is False
    assert (d["driver"]["loaded"], d["driver"]["version"], d["driver"]["flavor"]) == (True, "580.159.04", "open")
    assert {m["name"] for m in d["driver"]["modules"]} == {"nvidia", "nvidia_uvm"}
    assert d["runtimes"] == []
    assert d["nvml"]["available"] is True and d["nvml"]["source"] == "capture"
    assert d["nvml"]["devices"][0]["uuid"].startswith("GPU-")


def test_plan_on_real_gpu_host_upgrade_needs_reboot_and_checks_signers_after_the_fetch(unpack_host):
    """Signature enforcement alone no longer blocks a driver change: the package's signers are judged
    once its files are here (checked after the fetch, before anything is unloaded)."""
    root = unpack_host(H200)
    # the host's own driver (loaded, not on disk, no package record) is replaced only on request
    res = run_cli("plan", "--root", str(root), "--driver", "590.48.01", "--json",
                  env={"DRIVERD_DRIVER_MANAGE": "always", **A_REPO})
    assert res.returncode == 0, res.stderr
    p = json.loads(res.stdout)
    assert p["flavor"] == "open" and p["reboot_required"] is True and p["blocked_by"] == []
    assert p["signatures"]["status"] == "not-checked" and p["signatures"]["enforced"] is True
    assert "unload-modules" not in [s["action"] for s in p["steps"]]


def test_plan_on_real_gpu_host_same_driver(unpack_host):
    root = unpack_host(H200)
    res = run_cli("plan", "--root", str(root), "--driver", "580.159.04", "--json", check=True)
    p = json.loads(res.stdout)
    assert p["blocked_by"] == [] and p["reboot_required"] is False
    assert not {"fetch-package", "install-package", "load-modules"} & {s["action"] for s in p["steps"]}
    # host-managed: nothing of the driver's configuration is touched and no daemon started
    assert p["driver_managed_by"] == "the host (owner unknown)" and p["steps"] == []
    assert p["verdict"] == "converged" and p["modules"] == ["nvidia", "nvidia_uvm"]


def test_plan_on_real_gpu_host_another_version_is_left_to_the_host(unpack_host):
    root = unpack_host(H200)
    p = json.loads(run_cli("plan", "--root", str(root), "--driver", "590.48.01", "--json", check=True).stdout)
    assert p["verdict"] == "converged" and p["steps"] == []
    assert any("590.48.01 is not applied" in w for w in p["warnings"])


def test_no_gpu_host(unpack_host):
    root = unpack_host(NOGPU)
    res = run_cli("detect", "--root", str(root), check=True)
    assert "no NVIDIA GPU" in res.stdout
    res = run_cli("plan", "--root", str(root), "--driver", "570.195.03", "--json", check=True)
    p = json.loads(res.stdout)
    assert p["steps"] == [] and p["blocked_by"] == [] and p["nothing_to_do"] is True


def test_human_plan_and_help(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    res = run_cli("plan", "--root", str(tmp_path), "--driver", "570.195.03", check=True, env=A_REPO)
    assert "fetch-package" in res.stdout and "flavour:" in res.stdout
    assert "exit codes" in run_cli("--help").stdout
    assert "--root" in run_cli("plan", "--help").stdout


@pytest.mark.parametrize("args,code,words", [
    (["plan"], 2, "no driver version requested"),
    (["plan", "--driver", "banana"], 2, "invalid value 'banana' for driver.version"),
    (["plan", "--driver", "570.195.03", "--flavor", "proprietary"], 3, "proprietary kernel modules do not support"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_errors_are_one_line(tmp_path, args, code, words):
    b200 = Pci("0000:c3:00.0", "0x10de", "0x2901", "0x030200")
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0"), b200]))
    res = run_cli(*args, "--root", str(tmp_path))
    assert res.returncode == code
    assert words in res.stderr
    assert "Traceback" not in res.stderr
    if code != 2 or "invalid choice" not in words:
        assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1


def test_bad_config_file(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")],
                                  files={"/etc/driverd/config.toml": '[driver]\nflavour = "open"\n'}))
    res = run_cli("plan", "--root", str(tmp_path), "--json")
    assert res.returncode == 2
    assert json.loads(res.stdout)["error"].startswith("unknown key driver.flavour")


def _in_a_child(*commands: list[str], flags: tuple[str, ...] = (), **run_kw) -> tuple[list[tuple[int, str]], set[str]]:
    """driverd's main() for each command in one fresh interpreter (python3 `flags`): each command's exit
    code and output, and every module that interpreter imported (what a command's start-up pays for)."""
    code = ("import contextlib, io, json, sys; from driverd.cli import main\n"
            "runs = []\n"
            "for words in json.loads(sys.argv[1]):\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out):\n"
            "        try: rc = main(words)\n"
            "        except SystemExit as e: rc = e.code\n"
            "    runs.append([rc, out.getvalue()])\n"
            "sys.__stdout__.write(json.dumps({'runs': runs, 'modules': sorted(sys.modules)}))")
    res = subprocess.run([sys.executable, *flags, "-c", code, json.dumps(commands)], capture_output=True, text=True,
                         **run_kw)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    return [(rc, out) for rc, out in doc["runs"]], set(doc["modules"])


def _detect_without_site(root: Path, cwd: Path) -> tuple[int, dict, set[str]]:
    """`detect --root ROOT --json --no-nvml` in an interpreter without site (-S, only driverd and its
    dependencies on the path, run from `cwd`): its exit code, its JSON and every module it imported — what
    nothing but driverd could have imported."""
    path = [str(REPO)] + [p for p in sys.path if p]
    [(rc, out)], modules = _in_a_child(["detect", "--root", str(root), "--json", "--no-nvml"], flags=("-S",),
                                       cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(path)})
    return rc, json.loads(out), modules


def test_host_commands_never_import_kubernetes(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    runs, modules = _in_a_child(["detect", "--root", str(tmp_path), "--json"],
                                ["plan", "--root", str(tmp_path), "--driver", "570.195.03", "--json"])
    assert [m for m in modules if m.split(".")[0] in ("kubernetes", "requests", "tomlkit", "yaml",
                                                        "prometheus_client")] == [], runs


def test_detect_imports_no_command_runner_and_no_runtime_change(tmp_path):
    """detect runs no command of the host's and configures no runtime: driverd.runner (its two dataclasses,
    shutil, threading, signal) and driverd.runtime.changes (four dataclasses) stay out of its start-up
    (issue 47), although every runtime's module is imported to detect it."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    [(rc, _)], modules = _in_a_child(["detect", "--root", str(tmp_path), "--json"])
    assert rc == 0 and "driverd.runtime.docker" in modules
    assert {"driverd.runner", "driverd.runtime.changes"} & modules == set()


def test_detect_parses_toml_only_on_a_host_that_has_some(tmp_path):
    """tomllib (and the typing it imports) was ~4 ms of every detect (issue 47): a host with no TOML file
    to read does not import it; one with driverd's config file still has it parsed and checked."""
    bare, configured = tmp_path / "bare", tmp_path / "configured"
    write_host(bare, HostSpec(pci=[h100("0000:1b:00.0")]))
    write_host(configured, HostSpec(pci=[h100("0000:1b:00.0")],
                                    files={"/etc/driverd/config.toml": '[driver]\nflavour = "open"\n'}))
    [(rc, _)], modules = _in_a_child(["detect", "--root", str(bare), "--json"])
    assert rc == 0 and "tomllib" not in modules
    [(rc, out)], modules = _in_a_child(["detect", "--root", str(configured), "--json"])
    assert rc == 2 and "tomllib" in modules                       # read: its unknown key refused
    assert json.loads(out)["error"].startswith("unknown key driver.flavour"), out


def test_detect_reads_the_gpu_table_without_importlib_resources(tmp_path):
    """The GPU table is read from the package's directory: importlib.resources and its readers (zipfile,
    tempfile) were ~3 ms of every detect (issue 47). No site, so nothing but driverd can import them."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    rc, doc, modules = _detect_without_site(tmp_path, tmp_path)
    assert rc == 0 and doc["gpus"][0]["name"].startswith("NVIDIA H100"), doc
    assert {"importlib.resources", "zipfile", "tempfile"} & modules == set()


def test_detect_reads_the_host_by_strings_without_pathlib(tmp_path):
    """detect's reads name the host's files by strings: pathlib (with urllib.parse and ipaddress, ~3 ms)
    is imported only where a Path is handed out (issue 47). The config file's absence is read the same
    way."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    rc, doc, modules = _detect_without_site(tmp_path, tmp_path)
    assert rc == 0 and doc["kernel"]["release"], doc
    assert {"pathlib", "urllib.parse", "ipaddress"} & modules == set()


def test_detect_on_a_host_without_toml_imports_no_typing(tmp_path):
    """typing is 8-12 ms of detect's start on a GPU host (issue 47): driverd's modules on detect's path
    import it only for type checkers. A host with a TOML config (here containerd's) still imports it,
    through tomllib, which detect needs to read that file."""
    bare, toml = tmp_path / "bare", tmp_path / "toml"
    write_host(bare, HostSpec(pci=[h100("0000:1b:00.0")]))
    write_host(toml, HostSpec(pci=[h100("0000:1b:00.0")], files={"/etc/containerd/config.toml": "version = 2\n"}))
    for root, typed in ((bare, False), (toml, True)):
        rc, doc, modules = _detect_without_site(root, tmp_path)
        assert rc == 0 and doc["gpus"][0]["name"].startswith("NVIDIA H100"), doc
        assert ("typing" in modules) == typed and ("tomllib" in modules) == typed, (root, typed)


def test_detect_imports_neither_shutil_nor_unicodedata(tmp_path):
    """argparse's help formatter would import shutil (bz2, lzma, zlib) to ask the terminal's width, and
    redact unicodedata's tables, ~3.5 ms of detect's start on a GPU host between them (issue 47): neither
    is on its path."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    rc, doc, modules = _detect_without_site(tmp_path, tmp_path)
    assert rc == 0 and doc["gpus"], doc
    assert {"shutil", "bz2", "lzma", "unicodedata"} & modules == set()


@pytest.mark.parametrize("columns", ["50", "200", "", "junk"])
def test_help_is_wrapped_as_argparse_wraps_it(monkeypatch, columns):
    """driverd's parsers ask the terminal's width themselves (not through shutil): every command's help
    is the text argparse's own formatter writes for the same $COLUMNS."""
    import argparse

    from driverd.cli import build_parser
    from driverd.cli.options import Parser
    monkeypatch.setenv("COLUMNS", columns)

    def helps() -> list[str]:
        parser = build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return [parser.format_help()] + [sub.choices[c].format_help() for c in ("detect", "plan", "build", "daemon")]

    ours = helps()
    monkeypatch.setattr(Parser, "_get_formatter", argparse.ArgumentParser._get_formatter)
    assert ours == helps()
    if columns == "50":                 # detect's help is wrapped (the others keep their raw descriptions)
        assert max(len(line) for line in ours[1].splitlines()) <= 48


def test_one_commands_parser_imports_only_what_its_help_needs():
    """`driverd reload` (any command but build, build-matrix and runtime) does not import the distributions'
    and the container runtimes' tables to write other commands' help (issue 34: start-up is part of a
    reload's cost); the commands whose help names them still do."""
    [(rc, out)], modules = _in_a_child(["reload", "--help"])
    assert rc == 0 and "usage: driverd reload" in out
    assert [m for m in modules if m.startswith(("driverd.distro", "driverd.runtime.registry", "sqlite3"))] == []
    build = run_cli("build", "--help").stdout
    assert "/usr/src/linux-headers-RELEASE" in build.replace("\n", "").replace(" ", ""), build
    assert "(containerd, CRI-O, Docker)" in " ".join(run_cli("--help").stdout.split())


def test_a_commands_parser_imports_no_command_module_after_its_own():
    """detect's parser is built from host_cmds alone (the first command module): the other command modules,
    their imports with them, are not imported for it; a command a later module defines is still found."""
    [(rc, out)], modules = _in_a_child(["detect", "--help"])
    assert rc == 0 and "usage: driverd detect" in out
    from driverd.cli import COMMAND_MODULES
    assert COMMAND_MODULES[0] == "driverd.cli.host_cmds"
    assert sorted(m for m in modules if m in COMMAND_MODULES) == ["driverd.cli.host_cmds"], modules
    [(rc, out)], modules = _in_a_child(["completion", "--help"])
    assert rc == 0 and "usage: driverd completion" in out and set(COMMAND_MODULES) <= set(modules)


def test_capture_roundtrip(tmp_path):
    src = tmp_path / "src"
    write_host(src, HostSpec(pci=[h100("0000:1b:00.0", "nvidia")], sig_enforce=True,
                             modprobe_d={"/etc/modprobe.d/bl.conf": "blacklist nouveau\n"}))
    out = tmp_path / "cap.tar.gz"
    run_cli("debug", "capture-host", "--root", str(src), "--archive", str(out), check=True)
    dst = tmp_path / "dst"
    dst.mkdir()
    import tarfile
    from driverd import safetar
    with tarfile.open(out) as t:
        names = t.getnames()
    safetar.extract_file(out, dst, links="rooted")
    assert not any(n.startswith(("usr/src", "boot/vmlinuz")) and n.endswith(".ko") for n in names)
    a = json.loads(run_cli("detect", "--root", str(src), "--json", check=True).stdout)
    b = json.loads(run_cli("detect", "--root", str(dst), "--json", check=True).stdout)
    for d in (a, b):
        d.pop("root"), d.pop("nvml")
    assert a == b


def test_common_options_before_or_after_the_command(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    for args in (["--root", str(tmp_path), "--json", "detect"], ["detect", "--root", str(tmp_path), "--json"],
                 ["--json", "detect", "--root", str(tmp_path)]):
        d = json.loads(run_cli(*args, check=True).stdout)
        assert d["root"] == str(tmp_path) and d["gpus"][0]["pci_address"] == "0000:1b:00.0"


def test_cdi_spec_from_real_gpu_host(unpack_host):
    from driverd.root import Root
    from driverd.runtime import cdi
    spec = cdi.build(Root(unpack_host(H200)))
    names = [d["name"] for d in spec["devices"]]
    assert names == ["0", "GPU-6c1236f9-25a3-ea90-6fdc-40acd725cefd", "all"]
    assert cdi.validate(spec) == []


def test_kubectl_plugin_through_real_kubectl(tmp_path):
    """`kubectl driverd ...` is found by the real kubectl's plugin discovery, runs the cluster
    commands against the kubeconfig's cluster, and refuses host commands (a plugin runs on the
    admin's workstation, never on a node)."""
    import os
    import shutil
    from tests.conftest import require_binary
    kubectl = require_binary("kubectl")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    plugin = bindir / "kubectl-driverd"
    installed = shutil.which("kubectl-driverd", path=os.path.dirname(sys.executable))
    if installed:
        os.symlink(installed, plugin)
    else:   # running from a source tree without the console script: an equivalent wrapper
        plugin.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; from driverd.cli import kubectl_main; "
                          "sys.exit(kubectl_main())' \"$@\"\n")
        plugin.chmod(0o755)
    write_host(tmp_path / "host", HostSpec(pci=[h100("0000:1b:00.0")]))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    listed = subprocess.run([kubectl, "plugin", "list"], capture_output=True, text=True, env=env)
    assert str(plugin) in listed.stdout
    res = subprocess.run([kubectl, "driverd", "plan", "--root", str(tmp_path / "host"), "--driver", "570.195.03"],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "acts on the cluster" in res.stderr
    from tests.apiserver import ApiServer
    srv = ApiServer(host="127.0.0.1", port=0).start()
    try:
        srv.write_kubeconfig(tmp_path / "kubeconfig")
        srv.store.create("nodes", {"metadata": {"name": "gpu-a", "labels": {"driverd.io/driver-version": "535.261.03"}}})
        res = subprocess.run([kubectl, "driverd", "nodes", "-o", "json"], capture_output=True, text=True,
                             env={**env, "KUBECONFIG": str(tmp_path / "kubeconfig")})
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["nodes"][0] == {**json.loads(res.stdout)["nodes"][0], "node": "gpu-a",
                                                     "driver": "535.261.03", "state": "idle"}
    finally:
        srv.stop()


def test_plan_is_blocked_when_nothing_can_provide_the_package(tmp_path):
    """Issue 32: with no repository and no source, `plan` listed fetch-package and exited 0; `apply` then
    failed at it and claimed a validated rollback. The plan is blocked (one line: why, fix) and apply
    refuses before anything is journalled."""
    root = tmp_path / "h"
    write_host(root, HostSpec(pci=[h100("0000:1b:00.0")]))
    res = run_cli("plan", "--root", str(root), "--driver", "570.195.03", "--json")
    assert res.returncode == 3, res.stderr
    p = json.loads(res.stdout)
    assert p["verdict"] == "blocked" and len(p["blocked_by"]) == 1
    [why] = p["blocked_by"]
    assert why.startswith("nothing can provide the 570.195.03 (open) package for kernel 6.1.0-47-cloud-amd64: no "
                          "repository is configured (packages.repositories) and no local build: packages.source is "
                          "not set") and "; fix: set packages.repositories" in why and "\n" not in why
    res = run_cli("apply", "--root", str(root), "--driver", "570.195.03")
    assert res.returncode == 3
    [line] = res.stderr.splitlines()
    assert line.startswith("driverd: error: the plan is blocked: nothing can provide the 570.195.03 (open) package")
    assert line.count("fix: ") == 1 and "rolled back" not in line and "validated" not in line
    assert not (root / "var/lib/driverd/journal.json").exists()
    # a source without the kernel's headers cannot build either; a configured repository may have it
    (root / "usr/src/nvidia").mkdir(parents=True)
    p = json.loads(run_cli("plan", "--root", str(root), "--driver", "570.195.03", "--json",
                           env={"DRIVERD_PACKAGES_SOURCE": "/usr/src/nvidia"}).stdout)
    assert "no local build: kernel headers for 6.1.0-47-cloud-amd64 not found" in p["blocked_by"][0]
    p = json.loads(run_cli("plan", "--root", str(root), "--driver", "570.195.03", "--json", env=A_REPO).stdout)
    assert p["blocked_by"] == [] and "fetch-package" in [s["action"] for s in p["steps"]]


def test_capture_into_a_missing_directory_is_one_line(tmp_path):
    """`capture-host --archive /nonexistent/dir/x` ended in an "unexpected error" line after reading the host."""
    write_host(tmp_path / "h", HostSpec(pci=[h100("0000:1b:00.0")]))
    for out, words in ((tmp_path / "nope/dir/x.tar.gz", f"directory {tmp_path / 'nope/dir'} does not exist"),
                       (tmp_path, "it is a directory")):
        res = run_cli("debug", "capture-host", "--root", str(tmp_path / "h"), "--archive", str(out))
        assert res.returncode == 2
        [line] = res.stderr.splitlines()
        assert line.startswith(f"driverd: error: cannot write --archive {out}: {words}") and "unexpected" not in line


def _options() -> list[tuple[str, list[str]]]:
    """(command path, option strings) of every option of every command."""
    import argparse
    from driverd.cli import build_parser
    out = []

    def walk(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{path} {name}".strip())
            elif a.option_strings:
                out.append((path, list(a.option_strings), a))
    walk(build_parser(), "")
    return out


def test_one_vocabulary_every_spelling_of_a_concept_is_accepted_everywhere():
    """Issue 32: --flavour (the docs' word) was refused while --flavor worked; --workdir (demo) and
    --work-dir (build) were two spellings of one thing; --kernel meant a release in build and real|sim in
    apply. Every option named one way accepts the other, and real|sim is --kernel-backend."""
    opts = _options()
    flavor = [(c, o) for c, o, _ in opts if "--flavor" in o]
    assert {c for c, _ in flavor} >= {"plan", "apply", "build", "fetch", "prepare-kernel", "cluster rollout start"}
    assert all("--flavour" in o for _, o in flavor), flavor
    work = [(c, o) for c, o, _ in opts if "--work-dir" in o or "--workdir" in o]
    assert {c for c, _ in work} == {"build", "build-matrix", "demo"}
    assert all({"--work-dir", "--workdir"} <= set(o) for _, o in work), work
    backends = [(c, a) for c, o, a in opts if a.choices and "sim" in a.choices]
    assert {c for c, _ in backends} >= {"load", "unload", "reload", "rollback", "apply", "status"}
    for c, a in backends:      # real|sim is --kernel-backend; --kernel is only its hidden, deprecated spelling
        assert a.option_strings == ["--kernel-backend"] or (a.option_strings == ["--kernel"] and a.help == "==SUPPRESS==")
    releases = [c for c, o, a in opts if "--kernel" in o and not a.choices]
    assert set(releases) == {"build", "fetch", "install", "rollback-install"}
    forces = {c: a for c, o, a in opts if "--force" in o}
    # --force overrides a refusal that protects the fleet: a drain's PDB (rollout start), a cluster's
    # ownership of the node's driver (the commands that change it; issue 42)
    changers = {"apply", "load", "unload", "reload", "rollback", "install", "rollback-install", "fetch"}
    assert set(forces) == {"build", "cluster rollout start"} | changers and forces["build"].help == "==SUPPRESS=="
    assert all("only a DriverRollout changes it" in forces[c].help for c in changers)


def test_old_spellings_work_and_warn_once(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    res = run_cli("plan", "--root", str(tmp_path), "--driver", "570.195.03", "--flavour", "open", "--json", env=A_REPO)
    assert res.returncode == 0 and json.loads(res.stdout)["flavor"] == "open" and res.stderr == ""
    res = run_cli("status", "--root", str(tmp_path), "--kernel", "sim", "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip() == ("driverd: warning: --kernel is deprecated for real|sim (--kernel names a kernel "
                                  "release in build, fetch and install): use --kernel-backend")
    res = run_cli("status", "--root", str(tmp_path), "--kernel-backend", "sim", "--json")
    assert res.returncode == 0 and res.stderr == ""
    from driverd.cli import build_parser
    a = build_parser("build").parse_args(["build", "--source", "s", "--kernel", "6.1.0-47-cloud-amd64", "--flavour",
                                          "open", "--out", "o", "--force", "--workdir", "w"])
    assert (a.rebuild, a.flavor, a.work_dir, a.kernel) == (True, "open", "w", "6.1.0-47-cloud-amd64")
    assert a.deprecated == ["driverd: warning: --force is deprecated: use --rebuild"]
    a = build_parser("build").parse_args(["build", "--source", "s", "--kernel", "r", "--flavor", "open", "--out", "o"])
    assert a.rebuild is False and not getattr(a, "deprecated", None)


def test_a_missing_kubeconfig_is_bad_input(tmp_path):
    """It exited 3 where README's table says bad usage or configuration is 2."""
    res = run_cli("cluster", "nodes", "--kubeconfig", str(tmp_path / "nonexistent"))
    assert res.returncode == 2
    [line] = res.stderr.splitlines()
    assert f"kubeconfig {tmp_path / 'nonexistent'} does not exist" in line
    bad = tmp_path / "kubeconfig"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\ncurrent-context: x\nusers: []\n")
    bad.chmod(0o600)
    assert run_cli("cluster", "nodes", "--kubeconfig", str(bad)).returncode == 2


# -- issue 32, item 9: what the smaller outputs say ------------------------------------------------

def test_plan_lists_daemons_apart_from_modules(tmp_path):
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    out = run_cli("plan", "--root", str(tmp_path), "--driver", "570.195.03", check=True, env=A_REPO).stdout.splitlines()
    mods = next(ln for ln in out if ln.startswith("modules: "))
    assert "persistenced" not in mods and mods.startswith("modules: nvidia")
    assert "daemons: nvidia-persistenced" in out


def test_identical_gpus_are_one_block(tmp_path):
    addrs = [f"0000:{b:02x}:00.0" for b in (0x18, 0x28, 0x38, 0x48, 0x58, 0x68, 0x78, 0x88)]
    l40s = Pci("0000:c3:00.0", "0x10de", "0x26b9", "0x030200")
    write_host(tmp_path, HostSpec(pci=[h100(a) for a in addrs] + [l40s]))
    out = run_cli("gpus", "--root", str(tmp_path), check=True).stdout.splitlines()
    heads = [ln for ln in out if not ln.startswith(" ")]
    assert len(heads) == 2, out
    assert heads[0].startswith("8 × 0x2330 subsystem 10de:16c1  NVIDIA H100 80GB HBM3  (Hopper")
    assert out[1] == "  at:           " + ", ".join(addrs)
    assert heads[1].startswith("0000:c3:00.0  0x26b9")
    js = run_cli("gpus", "--root", str(tmp_path), "--json", check=True).stdout
    assert [g["pci_address"] for g in json.loads(js)["gpus"]] == addrs + ["0000:c3:00.0"]    # JSON: one per GPU


def test_status_leaves_an_unknown_refcount_out(tmp_path):
    from driverd.sim.hosttree import Module, nvidia_version_line
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0", "nvidia")], module_unload=False,
                                  modules=[Module("nvidia", 5000000, 2, ("nvidia_uvm",), version="570.195.03"),
                                           Module("nvidia_uvm", 100000, 0)],
                                  nvidia_version_text=nvidia_version_line("570.195.03", "open")))
    r = run_cli("status", "--root", str(tmp_path))
    assert "None" not in r.stdout, r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("nvidia "))
    assert "refcount" not in line and "holders nvidia_uvm" in line


def test_version_is_in_the_help_and_true():
    from importlib.metadata import version
    top = run_cli("--help").stdout
    assert "--version" in top and "print driverd's version and exit" in top and "driverd completion bash" in top
    assert run_cli("--version").stdout.strip() == f"driverd {version('driverd')}"


def test_bash_completion_from_the_parser(tmp_path):
    """The generated script, sourced by bash, completes commands, subcommands, options and their values."""
    import shutil
    bash = shutil.which("bash")
    script = run_cli("completion", "bash", check=True).stdout
    (tmp_path / "c.bash").write_text(script)
    (tmp_path / "out").mkdir()
    cases = [(["driverd", "bu"], "build build-userspace build-companion build-matrix"),
             (["driverd", "--root", "/x", "pl"], "plan"),
             (["driverd", "cluster", "rollout", "s"], "start status"),
             (["driverd", "build", "--fl"], "--flavor --flavour"),        # the alias completes too
             (["driverd", "build", "--flavor", ""], "open proprietary"),
             (["driverd", "--log-format", ""], "text json"),
             (["driverd", "runtime", "configure", "--runtime", "c"], "containerd crio"),
             (["driverd", "build", "--out", str(tmp_path / "ou")], str(tmp_path / "out")),
             (["driverd", "completion", ""], "bash")]
    lines = [f"source {tmp_path / 'c.bash'}"]
    for words, _ in cases:
        arr = " ".join("'" + w + "'" for w in words)
        lines.append(f"COMP_WORDS=({arr}); COMP_CWORD={len(words) - 1}; _driverd; echo \"${{COMPREPLY[*]}}\"")
    r = subprocess.run([bash, "--norc", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [want for _, want in cases]


def test_kubectl_driverd_nodes_escapes_what_a_node_wrote(tmp_path):
    """Issue 44, item 7: a node's own driverd.io/reason and message (any holder of that node's credential
    writes them) reach `kubectl driverd nodes` and `rollout status`: terminal escape sequences (retitle the
    window, clear the screen, hide the rest of the line) and bidirectional overrides are printed escaped,
    never sent to the admin's terminal; -o json keeps the exact value."""
    from tests.apiserver import ApiServer
    evil = "\x1b]0;owned\x07\x1b[2J\x1b[8mhidden\u202eevil\x9b31m"
    srv = ApiServer(host="127.0.0.1", port=0).start()
    try:
        kc = tmp_path / "kubeconfig"
        srv.write_kubeconfig(kc)
        srv.store.create("nodes", {"metadata": {
            "name": "gpu-a", "labels": {"driverd.io/driver-version": "535.261.03", "nvidia.com/gpu.present": "true"},
            "annotations": {"driverd.io/state": "failed", "driverd.io/rollout": "r1/1",
                            "driverd.io/reason": evil, "driverd.io/message": "msg " + evil}}})
        import yaml
        srv.store.create("customresourcedefinitions",
                         yaml.safe_load((REPO / "deploy/base/crd-driverrollout.yaml").read_text()))
        srv.store.create("driverrollouts", {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                            "metadata": {"name": "r1"}, "spec": {"driver": "550.127.05"}})
        for args in (["cluster", "nodes"], ["cluster", "nodes", "-o", "wide"], ["cluster", "rollout", "status", "r1"],
                     ["cluster", "rollout", "status", "r1", "-o", "wide"]):
            res = run_cli(*args, "--kubeconfig", str(kc))
            assert res.returncode in (0, 3), res.stderr
            out = res.stdout
            assert not any(c in out for c in "\x1b\x07\x9b\u202e"), (args, out)
            assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[8mhidden\\u202eevil\\x9b31m" in out, (args, out)
        res = run_cli("cluster", "nodes", "-o", "json", "--kubeconfig", str(kc))
        assert json.loads(res.stdout)["nodes"][0]["reason"] == evil
    finally:
        srv.stop()


def test_o_json_is_accepted_wherever_json_is(tmp_path):
    """Issue 48: `driverd status -o json` was refused ("unrecognized arguments") although every cluster verb
    takes -o; a command with --json takes kubectl's -o json / --output=json / -ojson for it, and a command
    with an -o of its own (the cluster verbs, build-matrix) keeps it."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0")]))
    want = run_cli("status", "--root", str(tmp_path), "--kernel-backend", "sim", "--json")
    assert want.returncode == 0, want.stderr
    for spelling in (["-o", "json"], ["--output=json"], ["-ojson"], ["--output", "json"]):
        r = run_cli("status", "--root", str(tmp_path), "--kernel-backend", "sim", *spelling)
        assert r.returncode == 0 and json.loads(r.stdout).keys() == json.loads(want.stdout).keys(), (spelling, r.stderr)
    r = run_cli("status", "--root", str(tmp_path), "--kernel-backend", "sim", "-o", "yaml")
    assert r.returncode == 2 and "-o" in r.stderr
    from driverd.cli import build_parser
    a = build_parser("build-matrix").parse_args(["build-matrix", "m.yaml", "-o", "json"])
    assert a.output == "json"


def test_kubectl_driverd_names_a_host_command_only_where_there_is_one():
    """Issue 48: `kubectl driverd get` pointed to a `driverd get` that does not exist."""
    r = run_cli_kubectl("get")
    assert r.returncode == 2 and "`driverd get`" not in r.stderr and "`driverd --help` lists the host commands" in r.stderr
    r = run_cli_kubectl("status")
    assert r.returncode == 2 and "`driverd status` is the host command, run on the node" in r.stderr


def run_cli_kubectl(*args: str):
    import subprocess
    import sys
    from tests.conftest import driverd_env
    return subprocess.run([sys.executable, "-c", "import sys; from driverd.cli import kubectl_main; "
                           "sys.exit(kubectl_main())", *args], capture_output=True, text=True, env=driverd_env(),
                          timeout=60, cwd="/")


def test_gpus_flavor_keeps_only_that_flavours_answer():
    """Issue 48: `gpus --driver` had no --flavor where every other command that judges a driver has one."""
    both = json.loads(run_cli("gpus", "2330", "--driver", "570.195.03", "--json", check=True).stdout)["gpus"][0]
    assert set(both["flavors"]) == set(both["verdicts"]) == {"open", "proprietary"}
    one = json.loads(run_cli("gpus", "2330", "--driver", "570.195.03", "--flavor", "proprietary", "--json",
                             check=True).stdout)["gpus"][0]
    assert set(one["flavors"]) == set(one["verdicts"]) == {"proprietary"}
    assert one["verdicts"]["proprietary"] == both["verdicts"]["proprietary"]
    text = run_cli("gpus", "2330", "--driver", "570.195.03", "--flavor", "open", check=True).stdout
    assert "570.195.03 open:" in text and "proprietary:" not in text, text


def test_a_read_only_command_leaves_without_tearing_the_interpreter_down(tmp_path):
    """Issue 47: after detect, plan, gpus, config and status the process leaves once its output is flushed
    (freeing every module and the GPU table cost detect ~15 ms); its output is whole and its exit code
    kept. Any other command exits as usual: here an atexit handler says whether the interpreter's
    teardown ran."""
    write_host(tmp_path, HostSpec(pci=[h100(f"0000:{b:02x}:00.0") for b in range(0x18, 0x98, 0x10)]))

    def run(*words: str) -> subprocess.CompletedProcess:
        code = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('torn down\\n')); "
                f"sys.argv = ['driverd', *{list(words)!r}]; from driverd.cli import entry; entry()")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    det = run("detect", "--root", str(tmp_path), "--json")
    assert det.returncode == 0 and "torn down" not in det.stderr, det.stderr
    assert len(json.loads(det.stdout)["gpus"]) == 8                 # all of it, through the pipe
    bad = run("plan", "--root", str(tmp_path), "--driver", "not-a-version", "--json")
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"] and "torn down" not in bad.stderr
    other = run("--version")
    assert other.returncode == 0 and other.stdout.startswith("driverd ") and "torn down" in other.stderr


def test_the_collector_is_paused_for_a_read_only_command_alone(tmp_path):
    """Issue 47: the console script pauses the cyclic garbage collector until the command is known; a
    read-only command (detect, status) runs without it, any other (apply, which may be the daemon's
    kind of work) with it, and main() called in-process leaves it as it was. The handler is replaced from
    the test side by one that prints whether the collector runs."""
    write_host(tmp_path, HostSpec(pci=[h100("0000:18:00.0")]))

    def collector_in(module: str, handler: str, *words: str) -> str:
        code = (f"import gc, sys, {module} as m; "
                f"m.{handler} = lambda ctx, args: print('collector', gc.isenabled()) or 0; "
                f"sys.argv = ['driverd', *{list(words)!r}]; from driverd.cli import entry; entry()")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    assert collector_in("driverd.cli.host_cmds", "cmd_detect", "detect", "--root", str(tmp_path)) == "collector False"
    assert collector_in("driverd.cli.lifecycle_cmds", "cmd_status", "status", "--root", str(tmp_path)) \
        == "collector False"
    assert collector_in("driverd.cli.lifecycle_cmds", "cmd_run", "apply", "--root", str(tmp_path),
                        "--driver", "535.261.03") == "collector True"
    inproc = ("import gc, sys, driverd.cli.host_cmds as m; "
              "m.cmd_detect = lambda ctx, args: print('collector', gc.isenabled()) or 0; "
              f"from driverd.cli import main; main(['detect', '--root', {str(tmp_path)!r}]); "
              "print('after', gc.isenabled())")
    r = subprocess.run([sys.executable, "-c", inproc], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.stdout.split() == ["collector", "True", "after", "True"], r.stderr
