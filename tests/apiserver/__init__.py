"""An in-memory Kubernetes API server on loopback for tests, the demo and benchmarks.

    from tests.apiserver import ApiServer
    srv = ApiServer().start()
    srv.write_kubeconfig(path)      # for kubectl and kubernetes.config.load_kube_config
    srv.store.create("pods", {...}) # direct storage access (see tests.apiserver.store)
    srv.stop()

What it emulates and what it does not: docs/apiserver.md.
"""
from tests.apiserver.errors import ApiError
from tests.apiserver.server import ApiServer
from tests.apiserver.store import Store

__all__ = ["ApiError", "ApiServer", "Store"]
