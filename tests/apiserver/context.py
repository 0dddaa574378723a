"""Per-request settings the storage layer needs without threading them through every call (thread-local)."""
from __future__ import annotations

import threading

_local = threading.local()


def set_field_validation(value: str | None) -> None:
    _local.field_validation = value or ""


def field_validation() -> str:
    return getattr(_local, "field_validation", "")
