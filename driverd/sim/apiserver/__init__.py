"""An in-memory Kubernetes API server on loopback for tests, the demo and benchmarks.

    from driverd.sim.apiserver import ApiServer
    srv = ApiServer().start()
    srv.write_kubeconfig(path)      # for kubectl and kubernetes.config.load_kube_config
    srv.store.create("pods", {...}) # direct storage access (see driverd.sim.apiserver.store)
    srv.stop()

What it emulates and what it does not: docs/apiserver.md.
"""
from driverd.sim.apiserver.errors import ApiError
from driverd.sim.apiserver.server import ApiServer
from driverd.sim.apiserver.store import Store

__all__ = ["ApiError", "ApiServer", "Store"]
