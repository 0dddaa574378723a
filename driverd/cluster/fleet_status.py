"""The fleet as the coordinator sees it, for the daemon's /metrics: per rollout, its phase and how many
of its target nodes are upgrading, done, failed, pending, skipped, excluded by the preflight or
NotReady past the bound — the counts admission decided on its last pass (the same numbers the
rollout's `status.nodes` carries, without waiting for the throttled status write). Only the daemon
holding the rollout Lease publishes them, so a scrape of every daemon counts each rollout once;
the others publish nothing and say they are not the coordinator.

The NVIDIA GPU Operator's upgrade controller exports the same kind of numbers for its own upgrades
(gpu-operator controllers/upgrade_controller.go: upgrades in progress, done, failed, pending,
available), one set per cluster; driverd's are per rollout (label `rollout`).
"""
from __future__ import annotations

import threading
from dataclasses import field

from driverd.cluster.states import PHASES as _PHASES
from driverd.datatypes import dataclass

PHASES = tuple(_PHASES)        # the values of driverd_rollout_phase's `phase` label
# status.nodes keys (admission.Decision.counts) -> the `state` label of driverd_rollout_nodes
STATES = {"upgrading": "upgrading", "done": "done", "failed": "failed", "pending": "pending",
          "skipped": "skipped", "excluded": "excluded", "notReady": "not_ready"}


@dataclass(frozen=True)
class RolloutCount:
    """One rollout's phase and node counts as admission last decided them, for /metrics."""
    rollout: str
    phase: str
    driver: str
    total: int
    nodes: dict = field(default_factory=dict)       # STATES' values -> count


@dataclass(frozen=True)
class Snapshot:
    """The fleet numbers this daemon publishes on /metrics: every rollout's counts while it is the coordinator."""
    coordinator: bool                               # this daemon holds the Lease and published last
    rollouts: tuple[RolloutCount, ...] = ()


def count(name: str, spec_driver: str, status: dict) -> RolloutCount:
    """One rollout's numbers from a status as admission computes it (`Decision.status`) or as the
    coordinator wrote it on the object."""
    nodes = status.get("nodes") or {}
    return RolloutCount(name, str(status.get("phase") or "Pending"), spec_driver, _int(nodes.get("total")),
                        {label: _int(nodes.get(key)) for key, label in STATES.items()})


def _int(v) -> int:
    try:
        return max(0, int(v or 0))
    except (TypeError, ValueError):
        return 0


class FleetStatus:
    """Written by the coordinator's thread, read by the HTTP thread at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = Snapshot(False)

    def publish(self, objects: list[dict], decided: dict[str, dict]) -> None:
        """After a pass as the Lease holder: every rollout not being deleted, with the status the pass
        decided for it (`decided`: name -> status) or, for one it did not decide on (ended, invalid),
        the status it carries."""
        out = []
        for obj in objects:
            md = obj.get("metadata") or {}
            if md.get("deletionTimestamp"):
                continue
            name = md.get("name", "")
            status = decided.get(name) or obj.get("status") or {}
            out.append(count(name, str((obj.get("spec") or {}).get("driver") or ""), status))
        with self._lock:
            self._snap = Snapshot(True, tuple(sorted(out, key=lambda c: c.rollout)))

    def clear(self) -> None:
        """The Lease went to another daemon: its numbers are that daemon's to publish now."""
        with self._lock:
            self._snap = Snapshot(False)

    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snap

