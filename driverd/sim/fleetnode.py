"""One simulated node's daemon in a process of its own: the real cluster agent and coordinator
candidate (what `driverd daemon` runs in cluster mode) on a driverd.sim.timedhost.TimedHost.
Started by driverd.sim.fleet.Fleet.spawn_node, so that a fleet bench's coordinator runs in its own
process as it does on a fleet; SIGTERM ends it the way a daemon ends (the Lease given up).

  python -m driverd.sim.fleetnode --kubeconfig K --node gpu-0001 --config-root DIR --driver V --flavor F
      --kernel R --lease-s 15 --reload-s S --validate-s S --preflight-s S --status FILE

Every 2 s, and when it ends, FILE gets {"requests": N, "pid": P}: the API calls its client made.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m driverd.sim.fleetnode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--kubeconfig", "--node", "--config-root", "--driver", "--flavor", "--kernel", "--status"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--lease-s", type=int, required=True)
    for flag in ("--reload-s", "--validate-s", "--preflight-s"):
        ap.add_argument(flag, type=float, required=True)
    a = ap.parse_args(argv)

    from driverd.cluster.agent import NodeAgent
    from driverd.cluster.coordinator import Coordinator
    from driverd.cluster.kube import Kube, Target
    from driverd.config import load
    from driverd.root import Root
    from driverd.sim.timedhost import NodeCosts, TimedHost

    def log(msg: str) -> None:
        print(msg, flush=True)
    cfg = load(Root(a.config_root), None, environ={})
    host = TimedHost(a.node, NodeCosts(a.reload_s, a.validate_s, a.preflight_s), loaded=(a.driver, a.flavor),
                     kernel=a.kernel)
    kube = Kube(Target(kubeconfig=a.kubeconfig))
    agent = NodeAgent(kube, a.node, host=host, cfg=cfg, log=log)
    coordinator = Coordinator(kube, a.node, "driverd", rollouts=agent.rollouts, pools=agent.pools, log=log,
                              lease_s=a.lease_s)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    threads = [threading.Thread(target=agent.run, name="agent", daemon=True),
               threading.Thread(target=coordinator.run, name="coordinator", daemon=True)]
    for t in threads:
        t.start()
    parent = os.getppid()

    def report() -> None:
        tmp = a.status + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"requests": kube.requests, "pid": os.getpid()}, fh)
        os.replace(tmp, a.status)
    while not done.wait(2.0):
        report()
        if os.getppid() != parent:          # the fleet is gone: so is its node
            break
    agent.close()
    coordinator.close()
    for t in threads:
        t.join(5)
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
