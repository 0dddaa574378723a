"""Which driver the daemon's own reconciles keep on a node in cluster mode — a pure function of the
node's rollout record, what the host has, and what the cluster declares for the node.

Once cluster mode is on, a driver is only ever *changed* through admission (a rollout: preflight,
limits, drain, canary, failure budget). The daemon's periodic reconcile therefore keeps:

- while the node is in a rollout, and after it is done: the rollout's target (`driverd.io/target`);
- after a failed upgrade: what ran when it failed (`driverd.io/pinned-driver`, else previous);
- otherwise (idle, given back): **the driver the host has** — the one loaded; with nothing loaded,
  the one driverd last converged the host to (the record of its last converge: nothing is loaded after a reboot, and after
  a kernel update not even a package for the new kernel is installed); failing that, the driverd
  package installed for the running kernel. A changed desired driver (its pool's, or `driver.version`
  of the node's configuration) waits for a rollout to admit the node.

Only a **joining** node installs its desired driver directly: no NVIDIA driver loaded, no record of
one driverd converged it to, no driverd package for its kernel. Such a node serves no GPU work — a pod
cannot use a GPU without a loaded driver, and GPU DaemonSets wait for `driverd.io/driver-ready`, which
the agent sets only once a driver is loaded — so there is nothing to drain and no capacity to lose;
and it goes straight to the driver its pool wants, so it is never ready on another one. A node that
merely rebooted is not joining: it loads back what it ran (a reboot of half the fleet must not
bypass a rollout's canary and failure budget).
"""
from __future__ import annotations


from driverd.cluster import states
from driverd.cluster.model import A_PINNED, A_PREVIOUS, A_STATE, A_TARGET, split_driver
from driverd.datatypes import dataclass


@dataclass(frozen=True)
class Desired:
    """The driver the cluster declares for a node: its pool's, or (in no pool) `driver.version` of its
    configuration. `version` None with `why`: none can be applied now (pools overlap on the node, the
    pools are not read yet, the configuration names no version)."""
    version: str | None
    flavor: str
    source: str                 # "pool NAME" | "configuration"
    why: str = ""

    @property
    def driver(self) -> str:
        return f"{self.version}/{self.flavor}" if self.version else ""


@dataclass(frozen=True)
class Keep:
    """What this pass of the daemon reconciles to: `version`/`flavor` (None: the configuration as it
    is), or nothing at all when `hold` says why."""
    version: str | None
    flavor: str | None
    source: str
    hold: str = ""
    joining: bool = False
    behind: str = ""            # the desired driver the node waits for a rollout to get, if it differs


def pinned(annotations: dict) -> Keep | None:
    """What the node's rollout record pins (the state table's `pin`): a rollout's target while it runs
    and once it is done, what ran when it failed; None in a state that pins nothing (idle)."""
    state = states.node_state(annotations.get(A_STATE))
    if state is None or state.pin is None:
        return None
    text = annotations.get(A_TARGET) if state.pin == states.PIN_TARGET else \
        annotations.get(A_PINNED) or annotations.get(A_PREVIOUS)
    version, flavor = split_driver(text)
    return Keep(version, flavor, f"the node's rollout record ({state.name})") if version else None


def keep(annotations: dict, have: dict | None, desired: Desired) -> Keep:
    """The driver this node's own reconcile keeps (see the module's text): `annotations` of its Node,
    `have` the driver its host has (driver.state.DriverState.has), `desired` its declared driver."""
    k = pinned(annotations)
    if k is not None:
        return k
    if have is not None:
        behind = desired.driver if desired.version and desired.version != have["version"] else ""
        return Keep(have["version"], have["flavor"] or None,
                    "the driver this node has" + (f" ({desired.source} wants {desired.version}: it waits for a "
                                                  "rollout to admit the node)" if behind else ""),
                    behind=behind)
    if desired.version is None:
        return Keep(None, None, desired.source, hold=f"a joining node (no driver yet) waits: {desired.why}",
                    joining=True)
    return Keep(desired.version, desired.flavor, f"joining: {desired.source}'s driver (no driver on the node yet)",
                joining=True)
