import json
from pathlib import Path

import pytest

from driverd import config
from driverd.errors import ConfigError
from driverd.root import Root


def write(tmp_path, text):
    (tmp_path / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (tmp_path / "etc/driverd/config.toml").write_text(text)
    return Root(tmp_path)


def test_defaults_without_file(tmp_path):
    cfg = config.load(Root(tmp_path), environ={})
    assert cfg["driver.flavor"] == "auto" and cfg["driver.version"] is None
    assert cfg.sources == {}


def test_file_and_env_override(tmp_path):
    root = write(tmp_path, '[driver]\nversion = "550.127.05"\nflavor = "open"\n'
                           '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = 1\n'
                           '[runtime]\nruntimes = ["containerd"]\n')
    cfg = config.load(root, environ={"DRIVERD_DRIVER_VERSION": "570.195.03", "DRIVERD_RUNTIME_SET_AS_DEFAULT": "yes"})
    assert cfg["driver.version"] == "570.195.03" and cfg.sources["driver.version"] == "env DRIVERD_DRIVER_VERSION"
    assert cfg["driver.flavor"] == "open" and cfg["runtime.set_as_default"] is True
    assert cfg["modules.parameters"] == {"nvidia": {"NVreg_EnableGpuFirmware": "1"}}
    assert cfg["runtime.runtimes"] == ["containerd"]


@pytest.mark.parametrize("text,words", [
    ('[driver]\nflavour = "open"\n', "unknown key driver.flavour"),
    ('[driver]\nflavor = "closed"\n', "driver.flavor must be one of auto, open, proprietary"),
    ('[driver]\nversion = "latest"\n', "driver.version must be a driver version like 535.261.03"),
    ('[drivers]\nversion = "1"\n', "unknown section [drivers]"),
    ('[runtime]\nruntimes = ["podman"]\n', "runtime.runtimes must be one of auto, containerd, crio, docker, none"),
    ('[modules]\nterminate_grace_s = -5\n', "modules.terminate_grace_s must be a whole number >= 0"),
    ('[driver\nversion=1\n', "not valid TOML"),
])
def test_invalid_file_is_one_line_error(tmp_path, text, words):
    with pytest.raises(ConfigError) as e:
        config.load(write(tmp_path, text), environ={})
    line = e.value.one_line()
    assert words in line and "\n" not in line and e.value.exit_code == 2


def test_invalid_env(tmp_path):
    with pytest.raises(ConfigError, match="DRIVERD_DRIVER_FLAVOUR"):
        config.load(Root(tmp_path), environ={"DRIVERD_DRIVER_FLAVOUR": "open"})
    with pytest.raises(ConfigError) as e:
        config.load(Root(tmp_path), environ={"DRIVERD_RUNTIME_CDI": "maybe"})
    assert "true or false" in e.value.one_line()


def test_env_names_are_unique():
    names = [config.env_name(k) for k in config.SCHEMA]
    assert len(names) == len(set(names))


def test_readme_documents_every_key():
    from tests.conftest import REPO
    readme = (REPO / "README.md").read_text()
    missing = [k for k in config.SCHEMA if k not in readme and not (k.startswith("signing.") and "signing.key / signing.cert" in readme)]
    assert not missing, f"README.md does not mention {missing}"


def test_config_prints_toml_driverd_loads_back_and_says_which_file(tmp_path):
    """Issue 32: `driverd config` printed Python values (None, True, 'auto') and did not say that the file
    was absent. It prints TOML (unset keys as comments) that loads back to the same values."""
    import tomllib
    from tests.conftest import run_cli
    root = tmp_path / "h"
    (root / "etc").mkdir(parents=True)
    r = run_cli("config", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"# driverd configuration: {root}/etc/driverd/config.toml (absent: defaults " \
                                       "and the environment only)"
    doc = tomllib.loads(r.stdout)
    assert doc["driver"] == {"flavor": "auto", "manage": "auto"} and doc["packages"]["build_fallback"] is True
    assert "# version = (unset, default)" in r.stdout and "None" not in r.stdout and "True" not in r.stdout
    (root / "etc/driverd").mkdir()
    (root / "etc/driverd/config.toml").write_text(
        '[driver]\nversion = "550.127.05"\n[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = 1\n'
        '[modules.parameters.nvidia_uvm]\n"odd key" = "a \\"quoted\\" value"\n'
        '[packages]\nrepositories = ["file:///srv/driverd"]\n')
    r = run_cli("config", "--root", str(root), env={"DRIVERD_RUNTIME_CDI": "yes"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].endswith("/etc/driverd/config.toml (read)")
    assert 'version = "550.127.05"' in r.stdout and "cdi = true" in r.stdout and "# env DRIVERD_RUNTIME_CDI" in r.stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(r.stdout)
    again = config.load(Root(root), str(printed), environ={})
    first = config.load(Root(root), environ={"DRIVERD_RUNTIME_CDI": "yes", "DRIVERD_MODULES_KERNEL": "sim"})  # run_cli keeps the kernel choice
    assert {k: again[k] for k in config.SCHEMA} == {k: first[k] for k in config.SCHEMA}
    j = json.loads(run_cli("config", "--root", str(root), "--json").stdout)
    assert j["read"] is True and j["values"]["driver.version"] == {"value": "550.127.05", "source": j["path"]}


def test_config_keys_says_which_keys_the_environment_can_set_and_how(tmp_path):
    from tests.conftest import run_cli
    r = run_cli("config", "--root", str(tmp_path), "--keys")
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()}
    assert "DRIVERD_MODULES_PARAMETERS" not in r.stdout
    assert "(file only: [modules.parameters.<module>])" in rows["modules.parameters"]
    assert "DRIVERD_PACKAGES_REPOSITORIES (comma-separated)" in rows["packages.repositories"]
    j = json.loads(run_cli("config", "--root", str(tmp_path), "--keys", "--json").stdout)
    assert j["modules.parameters"]["env"] is None and j["driver.version"]["env"] == "DRIVERD_DRIVER_VERSION"
    # every key it says the environment sets, the environment does set
    for key, row in j.items():
        if row["env"]:
            assert config.env_name(key) == row["env"]
    with pytest.raises(ConfigError, match="cannot be set from the environment"):
        config.load(Root(tmp_path), environ={"DRIVERD_MODULES_PARAMETERS": "x"})


def test_a_misspelt_key_gets_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as e:
        config.load(write(tmp_path, '[driver]\nflavour = "open"\n'), environ={})
    assert "fix: did you mean flavor? use one of: version, flavor, manage" in e.value.one_line()


def _other_value(key: str):
    """A valid value of `key` other than its default."""
    from driverd.config import SCHEMA
    spec = SCHEMA[key]
    if spec.type == "bool":
        return not spec.default if spec.default is not None else True
    if spec.type == "int":
        return spec.default + 7
    if spec.type == "params":
        return {"nvidia": {"NVreg_EnableGpuFirmware": "0"}}
    if spec.choices():
        return next(c for c in spec.choices() if c != spec.default)
    return {"userspace.root": "/srv/driverd/driver", "userspace.package": "/srv/driverd/userspace"}[key]


@pytest.mark.parametrize("key", [k for k in __import__("driverd.config", fromlist=["x"]).DRIVER_SETTINGS
                                 if k not in ("driver.version", "driver.flavor")])
def test_every_driver_setting_is_kept_as_converged_until_a_rollout(key):
    """Issue 42: a cluster-mode node keeps each driver setting at the value of its last converge; the
    edited value is what waits for a rollout (the driver's version and flavour are the rollout's target,
    decided by cluster/desired.py)."""
    from driverd.config import Config, keep_settings
    converged = Config({})
    recorded = json.loads(json.dumps(converged.driver_settings()))       # as the record on disk holds it
    edited = Config({key: _other_value(key)}, {key: "/etc/driverd/config.toml"})
    kept, waiting = keep_settings(edited, recorded, "node n: its last converge")
    assert kept[key] == converged[key] and kept.sources[key] == "node n: its last converge"
    assert len(waiting) == 1 and waiting[0].startswith(key), waiting
    same, none = keep_settings(converged, recorded, "x")
    assert same is converged and none == []


def test_the_driver_settings_are_listed_in_the_rollout_docs():
    """docs/rollouts.md lists every setting only a rollout applies in a cluster (config.DRIVER_SETTINGS)."""
    from driverd.config import DRIVER_SETTINGS
    text = (Path(__file__).resolve().parent.parent / "docs/rollouts.md").read_text()
    section = text.split("## Settings only a rollout changes", 1)[1].split("\n## ", 1)[0]
    assert [k for k in DRIVER_SETTINGS if f"`{k}`" not in section] == []
