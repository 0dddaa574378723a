"""The real kubectl for manifest tests: offline (`kubectl kustomize`) and against the loopback API
server of tests.apiserver when that module is there; and Kubernetes' own OpenAPI schema
(tests.apiserver.openapi.validate). Missing pieces skip with the reason (kubectl fails in CI)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import require_binary


def kubectl_binary() -> str:
    return require_binary("kubectl", "/usr/bin/kubectl")


def openapi_validate():
    """tests.apiserver.openapi.validate, or a skip saying it is not built yet."""
    try:
        from tests.apiserver.openapi import validate
    except ImportError as e:
        pytest.skip(f"tests.apiserver.openapi is not available ({e}): the Kubernetes OpenAPI schema "
                    "validator is built by the API-server simulator")
    return validate


def schema_errors(objs: list[dict]) -> dict[str, list[str]]:
    validate = openapi_validate()
    out = {}
    for o in objs:
        errs = validate(o)
        if errs:
            out[f"{o.get('kind')}/{(o.get('metadata') or {}).get('name')}"] = errs
    return out


def kubectl(env: dict, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run([kubectl_binary(), *args], input=input, capture_output=True, text=True, env=env,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


@contextlib.contextmanager
def api_server(tmp_path: Path) -> Iterator[dict]:
    """A running loopback API server and the environment that points kubectl at it."""
    kubectl_binary()
    try:
        from tests.apiserver import ApiServer
    except ImportError as e:
        pytest.skip(f"tests.apiserver.ApiServer is not available ({e})")
    srv = ApiServer(host="127.0.0.1", port=0).start()
    try:
        kc = tmp_path / "kubeconfig"
        srv.write_kubeconfig(str(kc))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env["KUBECONFIG"] = str(kc)
        env["HOME"] = str(tmp_path)          # kubectl's discovery cache stays in the test's directory
        yield env
    finally:
        srv.stop()
