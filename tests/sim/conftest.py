"""The loopback API server for these tests (bookmarks every 0.2 s so that watch tests see them
quickly), its kubeconfig, and an official client configured from it."""
from __future__ import annotations

import pytest
from kubernetes import config

from tests.apiserver import ApiServer


@pytest.fixture
def srv(tmp_path):
    s = ApiServer(bookmark_interval=0.2).start()
    s.write_kubeconfig(tmp_path / "kubeconfig")
    yield s
    s.stop()


@pytest.fixture
def client_config(srv, tmp_path):
    c = config.new_client_from_config(str(tmp_path / "kubeconfig"))
    yield c
    c.close()
