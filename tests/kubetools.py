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
