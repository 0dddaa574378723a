"""issue 32 item 2: the variables the kubelet gives every pod for each Service of its namespace
(service links) are not configuration. A Service named `driverd` or `driverd-metrics` - the usual
thing for a ServiceMonitor - made every DRIVERD_* link variable an "unknown environment variable"
and the driver container waited for it to change for ever.

The names below are made by the kubelet's rule (kubernetes pkg/kubelet/envvars/envvars.go,
FromServices and makeLinkVariables): the Service's name upper-cased with '-' as '_', then
_SERVICE_HOST, _SERVICE_PORT, _SERVICE_PORT_<PORT NAME> for each named port, _PORT for the first
port, and _PORT_<number>_<PROTOCOL> with _PROTO, _PORT and _ADDR for every port."""
from __future__ import annotations

import pytest

from driverd import config
from driverd.errors import ConfigError
from driverd.root import Root


def _env_name(s: str) -> str:
    return s.replace("-", "_").upper()


def service_links(service: str, ports: list[tuple[str, int, str]], ip: str = "10.96.14.7") -> dict[str, str]:
    """What the kubelet injects for one Service with a cluster IP; ports: (name or "", port, protocol)."""
    prefix = _env_name(service)
    env = {f"{prefix}_SERVICE_HOST": ip, f"{prefix}_SERVICE_PORT": str(ports[0][1])}
    for name, port, _ in ports:
        if name:
            env[f"{prefix}_SERVICE_PORT_{_env_name(name)}"] = str(port)
    for i, (_, port, proto) in enumerate(ports):
        url = f"{proto.lower()}://{ip}:{port}"
        if i == 0:
            env[f"{prefix}_PORT"] = url
        pp = f"{prefix}_PORT_{port}_{proto.upper()}"
        env.update({pp: url, f"{pp}_PROTO": proto.lower(), f"{pp}_PORT": str(port), f"{pp}_ADDR": ip})
    return env


SERVICES = [
    ("driverd", [("metrics", 9477, "TCP")]),
    ("driverd", [("", 9400, "TCP")]),
    ("driverd-metrics", [("http-metrics", 9477, "TCP"), ("dcgm", 9400, "TCP"), ("syslog", 514, "UDP")]),
    ("driverd-driver-version", [("sctp-x", 3868, "SCTP")]),       # looks like a key's prefix
    ("driverd-daemon", [("listen", 9477, "TCP")]),                # section name + a key's name as port name
    ("driverd-1", [("", 80, "TCP")]),
]


@pytest.mark.parametrize("service,ports", SERVICES)
def test_service_link_variables_are_not_configuration(tmp_path, service, ports):
    links = service_links(service, ports)
    assert all(n.startswith("DRIVERD_") for n in links)
    env = {**links, "DRIVERD_DRIVER_VERSION": "550.127.05"}
    cfg = config.load(Root(tmp_path), environ=env)
    assert cfg["driver.version"] == "550.127.05"
    assert set(cfg.sources) == {"driver.version"}                  # nothing else came from the environment
    assert cfg["daemon.listen"] == config.SCHEMA["daemon.listen"].default


def test_an_unknown_driverd_variable_is_still_refused(tmp_path):
    for name in ("DRIVERD_SERVICE_HOSTS", "DRIVERD_PORT_9477_TCP_HOST", "DRIVERD_PORT_X_TCP", "DRIVERD_DRIVER_FLAVOUR",
                 "DRIVERD_PORT_9477_ICMP", "DRIVERD__SERVICE_HOST"):
        with pytest.raises(ConfigError, match=name):
            config.load(Root(tmp_path), environ={name: "1"})


def test_no_configuration_key_has_a_service_link_name():
    """A key whose variable fits the kubelet's grammar would be set by a Service's link (a Service
    `driverd-x` with a key x.port: DRIVERD_X_PORT=tcp://...): keys must never take such names."""
    for key in config.SCHEMA:
        assert not config.is_service_link(config.env_name(key)), key
    for service, ports in SERVICES:
        assert all(config.is_service_link(n) for n in service_links(service, ports))
