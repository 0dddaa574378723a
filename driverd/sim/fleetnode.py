"""Simulated nodes' daemons in a process of their own: the real cluster agent and coordinator
candidate (what `driverd daemon` runs in cluster mode) on a driverd.sim.timedhost.TimedHost, each
node with its own client, informers and threads. Started by driverd.sim.fleet.Fleet.spawn_node (one
node: a fleet bench's coordinator runs in its own process as it does on a fleet) and spawn_group
(a share of a large fleet: no interpreter lock shared by all the fleet's daemons, which no fleet
has); SIGTERM ends it the way a daemon ends (the Lease given up).

  python -m driverd.sim.fleetnode --kubeconfig K --node gpu-0001 --config-root DIR --driver V --flavor F
      --kernel R --lease-s 15 --reload-s S --validate-s S --preflight-s S --status FILE
  python -m driverd.sim.fleetnode --nodes-file F.json ... (a list of {"node", "kubeconfig", "config_root",
      "processes": the file of the host's GPU processes, kept by the fleet's played kubelet})

Every 2 s, and when it ends, FILE gets {"requests": N, "pid": P}: the API calls its clients made.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m driverd.sim.fleetnode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--kubeconfig", "--node", "--config-root", "--nodes-file"):
        ap.add_argument(flag)
    for flag in ("--driver", "--flavor", "--kernel", "--status"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--lease-s", type=int, required=True)
    ap.add_argument("--no-coordinator", dest="coordinate", action="store_false",
                    help="the nodes' own side only (a coordinator of its own identity coordinates)")
    ap.add_argument("--switch-interval", type=float, help="the interpreter's switch interval (many nodes' threads)")
    for flag in ("--reload-s", "--validate-s", "--preflight-s"):
        ap.add_argument(flag, type=float, required=True)
    a = ap.parse_args(argv)
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)

    from driverd.cluster.agent import NodeAgent
    from driverd.cluster.coordinator import Coordinator
    from driverd.cluster.kube import Kube, Target
    from driverd.config import load
    from driverd.root import Root
    from driverd.sim.timedhost import NodeCosts, TimedHost

    def log(msg: str) -> None:
        print(msg, flush=True)
    if a.nodes_file:
        with open(a.nodes_file) as fh:
            nodes = [(d["node"], d["kubeconfig"], d["config_root"], d.get("processes")) for d in json.load(fh)]
    elif a.node and a.kubeconfig and a.config_root:
        nodes = [(a.node, a.kubeconfig, a.config_root, None)]
    else:
        ap.error("--node, --kubeconfig and --config-root, or --nodes-file")
    kubes, agents, coordinators = [], [], []
    pairs = []
    for name, kubeconfig, config_root, processes in nodes:
        cfg = load(Root(config_root), None, environ={})
        host = TimedHost(name, NodeCosts(a.reload_s, a.validate_s, a.preflight_s), loaded=(a.driver, a.flavor),
                         kernel=a.kernel, processes_file=processes)
        kube = Kube(Target(kubeconfig=kubeconfig))
        agent = NodeAgent(kube, name, host=host, cfg=cfg, log=log)
        kubes.append(kube)
        agents.append(agent)
        if a.coordinate:
            coordinators.append(Coordinator(kube, name, "driverd", rollouts=agent.rollouts, pools=agent.pools,
                                            log=log, lease_s=a.lease_s))
            pairs.append((f"coordinator-{name}", coordinators[-1]))
        pairs.append((f"agent-{name}", agent))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    threads = [threading.Thread(target=x.run, name=tname, daemon=True) for tname, x in pairs]
    for t in threads:
        t.start()
    parent = os.getppid()

    def report() -> None:
        tmp = a.status + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"requests": sum(k.requests for k in kubes), "pid": os.getpid()}, fh)
        os.replace(tmp, a.status)
    while not done.wait(2.0):
        report()
        if os.getppid() != parent:          # the fleet is gone: so is its node
            break
    for x in agents + coordinators:
        x.close()
    end = time.monotonic() + 5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
