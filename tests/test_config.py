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
