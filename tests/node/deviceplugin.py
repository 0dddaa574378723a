"""The stand-in GPU device plugin on the real node (tests/node/deviceplugin/main.go, built by
.ci/build-deviceplugin): its binary, its image (the static binary alone, an OCI layout made with umoci)
and the DaemonSet that runs it, as a cluster runs NVIDIA's device plugin."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import REPO, missing_component

IMAGE = "localhost/standin-device-plugin:test"
NS = "gpu-operator"


def binary() -> Path:
    out = subprocess.run(["bash", str(REPO / ".ci/build-deviceplugin"), "--print"], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    if subprocess.run(["bash", str(REPO / ".ci/build-deviceplugin"), "--check"], capture_output=True,
                      timeout=60).returncode != 0:
        missing_component(f"the stand-in device plugin {out} is not built (bash .ci/install-components builds it)")
    return Path(out)


def image(node) -> str:
    """The plugin's image in the node's containerd (imagePullPolicy Never); once per node (each test that runs
    the plugin asks for it)."""
    layout, bundle = node.dir / "standin-oci", node.dir / "standin-bundle"
    if (layout / "index.json").exists():
        return IMAGE
    umoci = node.bins["umoci"]
    for args in (("init", "--layout", str(layout)), ("new", "--image", f"{layout}:test"),
                 ("unpack", "--image", f"{layout}:test", str(bundle))):
        subprocess.run([umoci, *args], check=True, capture_output=True, timeout=120)
    shutil.copy2(binary(), bundle / "rootfs" / "standin")
    subprocess.run([umoci, "repack", "--image", f"{layout}:test", str(bundle)], check=True, capture_output=True,
                   timeout=120)
    subprocess.run([umoci, "config", "--image", f"{layout}:test", "--config.entrypoint", "/standin"], check=True,
                   capture_output=True, timeout=120)
    shutil.rmtree(bundle)
    return node.import_image(layout, "test", IMAGE)


def daemonset(name: str, host: Path, *, args: list[str], node_selector: dict | None) -> dict:
    """The plugin's DaemonSet: the kubelet's device-plugin directory and the host tree's /proc (the driver's
    version file) mounted; `node_selector` as NVIDIA's DaemonSets select their nodes."""
    spec = {"hostNetwork": True, "tolerations": [{"operator": "Exists"}], "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "plugin", "image": IMAGE, "imagePullPolicy": "Never",
                            "args": ["-driver-file", "/host-proc/driver/nvidia/version", *args],
                            "volumeMounts": [{"name": "plugins", "mountPath": "/var/lib/kubelet/device-plugins"},
                                             {"name": "proc", "mountPath": "/host-proc", "readOnly": True}]}],
            "volumes": [{"name": "plugins", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}},
                        {"name": "proc", "hostPath": {"path": str(host / "proc")}}]}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}}
