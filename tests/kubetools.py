"""The real kubectl for manifest tests (`kubectl kustomize` offline; against the real control plane
through tests/controlplane.py's kubeconfigs). A missing kubectl skips locally and fails in CI."""
from __future__ import annotations

import subprocess

from tests.conftest import require_binary


def kubectl_binary() -> str:
    return require_binary("kubectl", "/usr/bin/kubectl")


def kubectl(env: dict, *args: str, input: str | None = None, check: bool = True,
            timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run([kubectl_binary(), *args], input=input, capture_output=True, text=True, env=env,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def kubeconfig_token(path) -> str:
    """The bearer token a kubeconfig file (one user, as the tests write them) authenticates with."""
    import json
    from pathlib import Path
    return json.loads(Path(path).read_text())["users"][0]["user"]["token"]


def conditions(obj: dict | None) -> dict[str, dict]:
    """An object's status conditions by type. The API writes `conditions: null` where a list is not set
    yet (a CRD right after its creation), so a key present with null is read as none."""
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def condition_true(obj: dict | None, ctype: str) -> bool:
    return conditions(obj).get(ctype, {}).get("status") == "True"
