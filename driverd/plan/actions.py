"""The actions a step list may name and what each may change on the host: the vocabulary shared by
the planner (which builds step lists) and the executor (which runs them, with the implementations
in driverd.apply.steps — one for each name here, checked by tests/test_architecture.py)."""
from __future__ import annotations

from driverd.datatypes import dataclass


# What a step can change on the host; the rollback converges exactly the parts that were touched.
PACKAGE = "package"        # the installed driver package for the running kernel
MODULES = "modules"        # the loaded modules, their parameters and the GPU daemons
USERSPACE = "userspace"    # the driver's user-space driverd installed (userspace.root/current, ld.so, PATH)


@dataclass(frozen=True)
class Action:
    """One action a step may name, and which parts of the host it may change."""
    name: str
    touches: frozenset[str] = frozenset()
    read_only: bool = False    # records or verifies only (snapshot, checks, validate): never the reason
                               # a run happens, so a run of nothing else is "nothing to do"


def _a(name: str, *touches: str, read_only: bool = False) -> Action:
    return Action(name, frozenset(touches), read_only)


ACTIONS: dict[str, Action] = {a.name: a for a in (
    _a("snapshot", read_only=True),
    _a("blacklist-nouveau"), _a("unload-nouveau"),
    _a("fetch-package"), _a("verify-package", read_only=True),
    _a("install-package", PACKAGE),
    _a("fetch-userspace"), _a("install-userspace", USERSPACE), _a("restore-userspace", USERSPACE),
    # the companions (fabric manager ...) live beside the user-space: a rollback restores both
    _a("install-companion", USERSPACE), _a("restore-companion", USERSPACE),
    _a("restore-package", PACKAGE), _a("restore-previous-package", PACKAGE),
    _a("stop-gpu-daemons", MODULES), _a("start-gpu-daemons", MODULES),
    _a("start-persistenced", MODULES), _a("start-nvlsm", MODULES), _a("start-fabricmanager", MODULES),
    _a("start-imex", MODULES),
    _a("unload-modules", MODULES), _a("check-signers", read_only=True), _a("check-parameters", read_only=True),
    _a("load-modules", MODULES), _a("restore-mig"), _a("validate", read_only=True),
    _a("configure-runtime"), _a("revert-runtime"), _a("restore-files"),
    _a("require-reboot"), _a("clear-reboot"), _a("forget-kernel"),
)}


def touches_host_driver(steps: list[dict]) -> bool:
    """A step list that changes the package or the loaded driver (then it starts with a snapshot)."""
    return any(ACTIONS[s["action"]].touches for s in steps)
