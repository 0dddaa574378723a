"""`driverd cluster …` = `kubectl driverd …`: rolling driver upgrades across a Kubernetes cluster.
These commands act on the cluster through the kubeconfig (never on the local host), except
`cluster agent`, the node side, which a node's daemon runs."""
from __future__ import annotations

import argparse
import json
import sys
import time

from driverd.cli.kubeprint import _cells, _fmt, _print, _rollout_name, _shown, _yaml, add_watch, dry_said, watching
from driverd.cli.options import add_flavor

KUBECTL_EPILOG = """\
examples:
  kubectl driverd rollout start --driver 570.195.03 --max-parallel 10 --max-unavailable 5%
  kubectl driverd rollout status --watch
  kubectl driverd nodes
  kubectl driverd node retry gpu-node-17
the node daemons (deploy/) carry rollouts out: one node state machine each, admitted one writer at a
time through a Lease; every state has a reason on the Node (driverd.io/state, driverd.io/reason).
"""


OUTPUTS = ("table", "wide", "json", "yaml", "name")
# kubectl's own flags that take a value, which kubectl users put before the command too
# (`kubectl driverd -n driverd nodes`): kubectl_main moves them after it
VALUED_FLAGS = ("-n", "--namespace", "--kubeconfig", "--context", "-o", "--output", "-l", "--selector")


def _dry_run(p: argparse.ArgumentParser, what: str) -> None:
    """kubectl's --dry-run for a verb that writes: client prints what it would send, server has the API
    server judge it (admission included) and stores nothing; a bare --dry-run is client, as in kubectl."""
    p.add_argument("--dry-run", nargs="?", const="client", default="none", choices=("none", "client", "server"),
                   help=f"client: print {what} without sending it; server: the API server judges it (schema, "
                        "RBAC, admission) and stores nothing (as kubectl's --dry-run)")


def _kube_args(p: argparse.ArgumentParser, namespace: bool = True) -> None:
    g = p.add_argument_group("cluster access (as kubectl)")
    g.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or "
                   "the pod's service account in a cluster)")
    g.add_argument("--context", metavar="NAME", help="kubeconfig context to use")
    if namespace:
        g.add_argument("-n", "--namespace", metavar="NS", help="accepted as kubectl accepts it; DriverRollouts and "
                       "Nodes are cluster-scoped, so it selects nothing here (kubectl ignores it for them too)")
    g.add_argument("-o", "--output", choices=OUTPUTS, default=None, metavar="FORMAT",
                   help="table (default), wide (more columns), json, yaml, name (KIND/NAME per line); "
                        "--json is -o json")


def register(sub, common) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    c = sub.add_parser("cluster", formatter_class=fmt, epilog=KUBECTL_EPILOG,
                       help="rolling driver upgrades across a Kubernetes cluster (also: kubectl driverd)",
                       description="Coordinate driver upgrades across a cluster: a DriverRollout resource says "
                       "which driver the selected nodes should run and how fast; the driverd daemon on each node "
                       "drains, upgrades through its node transaction (rolled back on failure), validates and "
                       "uncordons, recording every state with its reason on the Node.")
    c.set_defaults(help_of=c)
    csub = c.add_subparsers(dest="cluster_command", metavar="COMMAND")
    register_kubectl(csub, common)
    p = csub.add_parser("agent", parents=[common], formatter_class=fmt,
                        help="run this node's side of rollouts (state machine + coordinator election)",
                        description="Runs the node state machine for NODE and takes part in the election of "
                        "the coordinator (the daemon holding the Lease admits nodes and writes rollout status). "
                        "The host is --root (/ on a host, /host in the driver container). Stops on SIGTERM.")
    p.add_argument("--node", metavar="NAME", help="this node's name (default: cluster.node_name, $NODE_NAME, "
                   "the host name)")
    p.add_argument("-n", "--namespace", metavar="NS", default=None, help="namespace of the coordination Lease "
                   "(default: $POD_NAMESPACE or driverd)")
    _kube_args(p, namespace=False)
    p.set_defaults(handler=cmd_agent)
    p = csub.add_parser("coordinator", parents=[common], formatter_class=fmt,
                        help="run the coordinator alone: admit nodes into rollouts, write their status",
                        description="Takes part in the election of the coordinator (the holder of the Lease "
                        "NS/driverd-rollout) and, while it holds the Lease, admits nodes into DriverRollouts under "
                        "their limits and writes the rollouts' and DriverPools' status. It runs no node's driver: "
                        "run it as its own Deployment and ServiceAccount (deploy/base/coordinator.yaml), so that "
                        "no GPU node's identity can coordinate, and set cluster.coordinate = false on the nodes. "
                        "Several replicas: one holds the Lease, the others take over within its duration (15 s). "
                        "Stops on SIGTERM, giving the Lease up.",
                        epilog="examples:\n  driverd cluster coordinator                 # in its pod: $POD_NAME, "
                        "$POD_NAMESPACE\n  driverd cluster coordinator --kubeconfig ~/.kube/config --identity "
                        "ops-laptop")
    p.add_argument("--identity", metavar="NAME", help="the name it holds the Lease in (default: $POD_NAME, then the "
                   "host name)")
    p.add_argument("--listen", metavar="ADDR:PORT", help="serve /metrics (driverd_coordinator, driverd_rollout_*), "
                   "/healthz and /readyz there (deploy/: 0.0.0.0:9478); default: none")
    p.add_argument("-n", "--namespace", metavar="NS", default=None, help="namespace of the coordination Lease "
                   "(default: $POD_NAMESPACE or cluster.namespace)")
    _kube_args(p, namespace=False)
    p.set_defaults(handler=cmd_coordinator)


def register_kubectl(sub, common) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    r = sub.add_parser("rollout", formatter_class=fmt, help="start, watch, pause, resume or abort a rollout")
    r.set_defaults(help_of=r)
    rsub = r.add_subparsers(dest="rollout_command", metavar="COMMAND")
    p = rsub.add_parser("start", parents=[common], formatter_class=fmt, help="set a pool's driver, or create a "
                        "DriverRollout for nodes in no pool",
                        description="With --pool: the DriverPool's desired driver becomes V (the policy flags given "
                        "become its policy; with --selector a missing pool is created): the coordinator rolls the "
                        "pool's nodes to it in the pool's next DriverRollout, and nodes that join the pool later "
                        "install it. Without --pool: a DriverRollout for nodes in no pool (a selector that reaches a "
                        "pool's nodes is refused): the selected nodes move to driver V, at most --max-parallel at a "
                        "time and never more than --max-unavailable unavailable. Either way every node's daemon "
                        "first answers a preflight (package for its kernel, signer, GPU support, reboot); nothing "
                        "starts while one would fail (or those are left out with --preflight Exclude).\n\n"
                        "examples:\n  kubectl driverd rollout start --pool a100 --driver 570.195.03 --max-parallel 5\n"
                        "  kubectl driverd rollout start --pool h100 --selector gpu=h100 --driver 570.195.03 --canary 1\n"
                        "  kubectl driverd rollout start --driver 570.195.03 --selector zone=lab --max-unavailable 10%")
    p.add_argument("--driver", required=True, metavar="VERSION", help="driver version, e.g. 570.195.03")
    p.add_argument("--pool", metavar="NAME", help="set this DriverPool's driver (created with --selector if missing)")
    add_flavor(p, default=None, help="default: auto (a pool keeps its own)")
    p.add_argument("--selector", "-l", default="", metavar="LABELS", help="node label selector (kubectl syntax)")
    # policy flags default to None: for a pool only the flags given change its policy
    p.add_argument("--max-parallel", type=int, default=None, metavar="N", help="default 1")
    p.add_argument("--max-unavailable", default=None, metavar="N|P%", help="a number >= 1 or a percentage "
                   "1%%..100%% of the target nodes (rounded down, at least 1; default 1)")
    p.add_argument("--canary", type=int, default=None, metavar="N", help="upgrade N nodes first, then pause")
    p.add_argument("--canary-soak", type=int, default=None, metavar="SECONDS",
                   help="continue after the canary nodes have run this long instead of pausing")
    p.add_argument("--failure-budget", type=int, default=None, metavar="N", help="failed nodes tolerated before "
                   "the rollout pauses (default 0: the first failure pauses it)")
    p.add_argument("--preflight", default=None, choices=("Refuse", "Exclude"), help="default Refuse")
    p.add_argument("--drain-timeout", type=int, default=None, metavar="SECONDS", help="default 600")
    p.add_argument("--force", action="store_true", help="delete GPU pods whose eviction is still refused after "
                   "the drain timeout (default: the node fails, naming the PodDisruptionBudget)")
    p.add_argument("--delete-emptydir-data", action="store_true",
                   help="also evict pods with emptyDir volumes, whose data is lost (as kubectl drain's flag; "
                   "default: such pods fail the node's drain, naming them)")
    p.add_argument("--wait-for-jobs", default="", metavar="LABELS", help="pods to let finish before evicting")
    p.add_argument("--validation-pod-image", default=None, metavar="IMAGE",
                   help="once a node's GPUs are schedulable again, run a pod of this image on it (runtimeClassName "
                        "nvidia, one nvidia.com/gpu when the node publishes it, in driverd's namespace); the node is "
                        "done only when it succeeds, else it fails WorkloadPodFailed (spec.validation.workloadPod; "
                        "default: no pod)")
    p.add_argument("--validation-pod-command", default=None, metavar="COMMAND",
                   help="the pod's command, split as a shell would (e.g. \"/cuda-samples/vectorAdd\"; default: the "
                        "image's entrypoint); exit 0 passes")
    p.add_argument("--validation-pod-timeout", type=int, default=None, metavar="SECONDS",
                   help="how long the pod may take to succeed (default: the validation timeout, 300)")
    p.add_argument("--name", help="rollout name (default: driver-<version>)")
    p.add_argument("--dry-run", nargs="?", const="client", default="none", choices=("none", "client", "server"),
                   help="client: print the DriverRollout that would be created (with -o yaml: the manifest, for "
                        "GitOps) without contacting the cluster; server: have the API server validate it without "
                        "storing it (as kubectl's --dry-run)")
    _kube_args(p)
    p.set_defaults(handler=cmd_start)
    p = rsub.add_parser("status", parents=[common], formatter_class=fmt, help="a rollout's nodes and summary",
                        description="The rollout's phase, its nodes (state, reason, since) and a summary; "
                        "--watch follows it until it ends.")
    p.add_argument("name", nargs="?", help="rollout (default: the only or newest one)")
    p.add_argument("--watch", "-w", action="store_true", help="print again at every change until the rollout "
                   "ends (Completed, Paused or Failed); exit 0 only when it completed")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS", help="with --watch: give up after this")
    _kube_args(p)
    p.set_defaults(handler=cmd_status)
    for verb, what in (("pause", "stop admitting nodes (nodes mid-upgrade finish)"),
                       ("resume", "admit nodes again (also continues after the canary nodes)"),
                       ("abort", "stop the rollout; nodes not yet unloading are uncordoned and given back"),
                       ("delete", "delete the rollout: an abort, after which the resource goes once its nodes "
                        "are given back or finished")):
        p = rsub.add_parser(verb, parents=[common], help=what, description=what)
        p.add_argument("name", nargs="?", help="rollout (default: the only or newest one)")
        _dry_run(p, "the change")
        _kube_args(p)
        p.set_defaults(handler=cmd_verb, verb=verb)
    p = rsub.add_parser("undo", parents=[common], formatter_class=fmt,
                        help="roll the nodes a rollout upgraded back to the driver each ran before",
                        description="A DriverPool's rollout: the pool's driver goes back to the one before that "
                        "revision (the coordinator rolls it out under the pool's policy). Any other rollout: create "
                        "a rollout back to each node's previous driver (driverd.io/previous-driver on the nodes NAME "
                        "upgraded): one rollout per previous driver, selecting those nodes by kubernetes.io/hostname, "
                        "with NAME's pace (maxParallel, maxUnavailable, drain).")
    p.add_argument("name", help="the rollout to undo")
    _dry_run(p, "the rollouts (or the pool's change) it would make")
    _kube_args(p)
    p.set_defaults(handler=cmd_undo)
    n = sub.add_parser("node", help="retry or skip one node")
    n.set_defaults(help_of=n)
    nsub = n.add_subparsers(dest="node_command", metavar="COMMAND")
    for verb, what in (("retry", "admit a failed node again"), ("skip", "leave a node out of rollouts"),
                       ("unskip", "let a skipped node take part again")):
        p = nsub.add_parser(verb, parents=[common], help=what, description=what)
        p.add_argument("node")
        _dry_run(p, "the change")
        _kube_args(p)
        p.set_defaults(handler=cmd_node, verb=verb)
    from driverd.cli import pool_cmds
    pool_cmds.register(sub, common, _kube_args, _kube, _print)
    p = sub.add_parser("nodes", parents=[common], help="driver, flavour, state, reason and since, per node")
    p.add_argument("--selector", "-l", default="", metavar="LABELS",
                   help="only the nodes with these labels (kubectl syntax: key=value,key!=value,key)")
    add_watch(p, "the nodes")
    _kube_args(p)
    p.set_defaults(handler=cmd_nodes)


def _kube(args):
    """A person's command: a cluster that cannot be reached is said at once, in one line (kubectl answers
    a refused connection in well under a second); only "try later" answers are retried."""
    from driverd.cluster.kube import Kube, Target
    return Kube(Target(kubeconfig=args.kubeconfig, context=args.context), retry_for_s=20, fail_fast=True,
                connect_timeout_s=5)


def cmd_start(ctx, args) -> int:
    from driverd.cluster import model as m
    from driverd.cluster.kube import KubeError, rollout_path
    from driverd.errors import UsageError
    if not m.VERSION_RE.match(args.driver):
        raise UsageError(f"--driver {args.driver!r} is not a driver version", fix="pass e.g. --driver 570.195.03")
    try:
        labels, exprs = m.selector_string(args.selector)
    except ValueError as e:
        raise UsageError(f"--selector: {e}", fix="use kubectl's syntax, e.g. pool=a100,zone in (a,b)") from None
    mu: int | str = args.max_unavailable if args.max_unavailable is not None else "1"
    if isinstance(mu, str) and mu.isdigit():
        mu = int(mu)
    if args.pool:
        from driverd.cli import pool_cmds
        if args.name:
            raise UsageError("--name names a rollout; a pool's rollouts are named <pool>-<revision>",
                             fix="leave --name out with --pool")
        return pool_cmds.start(lambda: _kube(args), args, labels, exprs, mu, _print)
    name = args.name or "driver-" + args.driver.replace(".", "-")
    spec = {"driver": args.driver, "flavor": args.flavor or "auto", "maxParallel": _or(args.max_parallel, 1),
            "maxUnavailable": mu, "canary": _or(args.canary, 0), "failureBudget": _or(args.failure_budget, 0),
            "preflight": args.preflight or "Refuse",
            "drain": {"timeoutSeconds": _or(args.drain_timeout, 600), "force": args.force,
                      "deleteEmptyDirData": args.delete_emptydir_data}}
    if labels or exprs:
        spec["nodeSelector"] = {k: v for k, v in (("matchLabels", labels), ("matchExpressions", list(exprs))) if v}
    if args.canary_soak is not None:
        spec["canarySoakSeconds"] = args.canary_soak
    if args.wait_for_jobs:
        spec["waitForJobs"] = {"podSelector": args.wait_for_jobs}
    from driverd.cli.pool_cmds import validation_flags
    validation = validation_flags(args)
    if validation:
        spec["validation"] = validation
    obj = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": name}, "spec": spec}
    try:
        m.Rollout.from_object(dict(obj, metadata={"name": name, "generation": 1}))
    except m.SpecError as e:
        raise UsageError(f"invalid rollout: {e}", fix="see `kubectl driverd rollout start --help`") from None
    if args.dry_run == "client":        # the manifest, for a GitOps repository: no cluster needed
        _print(args, obj, f"{_rollout_name(name)} created (dry run)", names=[_rollout_name(name)])
        return 0
    kube = _kube(args)
    from driverd.cli import pool_cmds
    pool_cmds.refuse_pool_members(kube, obj)
    try:
        created = kube.create(rollout_path(), obj, dry_run=args.dry_run == "server")
        if args.dry_run == "server":
            _print(args, created, f"{_rollout_name(name)} created (server dry run)", names=[_rollout_name(name)])
            return 0
        _warn_if_no_targets(kube, m.Rollout.from_object(created), args.selector)
    except KubeError as e:
        if e.status == 409:
            raise UsageError(f"a rollout named {name} already exists", fix=f"watch it with `kubectl driverd rollout "
                             f"status {name}`, or pass --name") from None
        if e.status == 404:
            raise UsageError("the DriverRollout resource is not installed in this cluster",
                             fix="kubectl apply -k deploy/base (it holds the CRD)") from None
        if e.status == 422:
            raise UsageError(f"the API server rejected the rollout: {e.api_message}", fix="fix the named field") from None
        raise
    _print(args, created, f"{_rollout_name(name)} created: driver {args.driver} on "
           f"{args.selector or 'every node'} (max {spec['maxParallel']} at a time, max unavailable {mu}); "
           f"follow it with: kubectl driverd rollout status {name} --watch", names=[_rollout_name(name)])
    return 0


def _or(value, default):
    return default if value is None else value


def _warn_if_no_targets(kube, r, selector: str) -> None:
    """A rollout whose selector matches no node would end at once, having done nothing: say so."""
    from driverd.cluster.kube import node_path
    try:
        nodes = kube.list(node_path(), labels=r.label_selector() or None).get("items") or []
    except Exception:        # the warning is a courtesy; the rollout exists
        return
    if not any(r.selects((n.get("metadata") or {}).get("labels") or {}) for n in nodes):
        print(f"warning: no node matches {selector or 'the selector'!r}: rollout {r.name} will touch no node "
              "(check the labels with `kubectl get nodes --show-labels`)", file=sys.stderr)


def _pick(kube, name: str | None) -> dict:
    from driverd.cluster.kube import rollout_path
    from driverd.errors import UsageError
    if name:
        obj = kube.find(rollout_path(name))
        if obj is None:
            raise UsageError(f"no rollout named {name}", fix="list them with `kubectl get driverrollouts`")
        return obj
    items = kube.list(rollout_path()).get("items") or []
    if not items:
        raise UsageError("there is no rollout", fix="start one with `kubectl driverd rollout start --driver V`")
    return max(items, key=lambda o: o["metadata"].get("creationTimestamp", ""))


def cmd_status(ctx, args) -> int:
    from driverd.cli.rollout_status import _exit, _human_status, status_doc
    from driverd.cluster.kube import node_path
    kube = _kube(args)
    obj = _pick(kube, args.name)
    if not args.watch:
        d = status_doc(obj, kube.list(node_path()).get("items") or [])
        _print(args, d, _human_status, wide=lambda x: _human_status(x, wide=True),
               names=[_rollout_name(d["rollout"])])
        return _exit(d)
    return _watch_status(kube, args, obj["metadata"]["name"])


def _watch_status(kube, args, name: str) -> int:
    from driverd.cli.rollout_status import _exit, _human_status, status_doc
    import threading

    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import node_path, rollout_path
    from driverd.cluster.states import ENDED
    changed = threading.Event()
    ro = Informer(kube, rollout_path(), fields=f"metadata.name={name}", on_change=lambda k, o: changed.set()).start()
    nodes = Informer(kube, node_path(), on_change=lambda k, o: changed.set()).start()
    ro.synced.wait(30)
    nodes.synced.wait(30)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    last = None
    try:
        while True:
            changed.clear()
            obj = ro.get(name)
            if obj is None:
                print(f"rollout {name} was deleted", file=sys.stderr)
                return 1
            d = status_doc(obj, nodes.snapshot())
            if json.dumps(d, sort_keys=True) != last:
                last = json.dumps(d, sort_keys=True)
                f = _fmt(args)
                if f in ("table", "wide"):
                    print(time.strftime("%H:%M:%S ") + _human_status(d, wide=f == "wide") + "\n", flush=True)
                elif f == "name":
                    print(f"{_rollout_name(name)} {d['phase']}", flush=True)
                else:
                    print(json.dumps(d, sort_keys=True) if f == "json" else "---\n" + _yaml(d), flush=True)
            if d["phase"] in ENDED and (obj.get("status") or {}).get("observedGeneration") == \
                    obj["metadata"].get("generation"):
                return _exit(d, ended_only=True)
            if deadline is not None and time.monotonic() > deadline:
                print(f"rollout {name}: still {d['phase']} after {args.timeout:.0f}s", file=sys.stderr)
                return 3
            changed.wait(0.5 if deadline is None else max(0.05, min(5.0, deadline - time.monotonic())))
            time.sleep(0.2)    # coalesce bursts of changes into one print
    finally:
        ro.close()
        nodes.close()


def cmd_verb(ctx, args) -> int:
    from driverd.cluster.admission import A_CANARY_APPROVED
    from driverd.cluster.kube import rollout_path
    from driverd.cluster.model import A_ABORT
    kube = _kube(args)
    obj = _pick(kube, args.name)
    name = obj["metadata"]["name"]
    if args.verb == "delete":
        if args.dry_run != "client":
            kube.delete(rollout_path(name), dry_run=args.dry_run == "server")
        _print(args, {"deleted": name, "dryRun": args.dry_run}, f"{_rollout_name(name)} deleted{dry_said(args)}"
               + ("" if args.dry_run != "none" else ": no more nodes are admitted; nodes not yet unloading are "
                  "given back, then the resource goes"), names=[_rollout_name(name)])
        return 0
    patch = {"pause": {"spec": {"paused": True}},
             "resume": {"spec": {"paused": False}, "metadata": {"annotations": {A_CANARY_APPROVED: "true"}}},
             "abort": {"spec": {"paused": True}, "metadata": {"annotations": {A_ABORT: "true"}}}}[args.verb]
    # client: the patch it would send, as kubectl prints the object a dry run would change
    new = {"patch": patch, "rollout": name} if args.dry_run == "client" else \
        kube.patch(rollout_path(name), patch, dry_run=args.dry_run == "server")
    done = "aborted" if args.verb == "abort" else f"{args.verb}d"
    _print(args, new, f"{_rollout_name(name)} {done}{dry_said(args)}" + (
        ": no more nodes are admitted; nodes not yet unloading are given back"
        if args.verb == "abort" and args.dry_run == "none" else ""), names=[_rollout_name(name)])
    return 0


def cmd_undo(ctx, args) -> int:
    """One new rollout per previous driver of the nodes NAME upgraded (done, or failed after the new
    driver stayed), selecting them by hostname, with NAME's pace."""
    from driverd.cluster import model as m
    from driverd.cluster.kube import KubeError, node_path, rollout_path
    from driverd.errors import UsageError
    kube = _kube(args)
    obj = _pick(kube, args.name)
    from driverd.cluster import pools as pl
    if pl.owner(obj) is not None:
        from driverd.cli import pool_cmds
        return pool_cmds.undo(kube, args, obj, _print)
    try:
        r = m.Rollout.from_object(obj)
    except m.SpecError as e:
        raise UsageError(f"rollout {args.name} is invalid: {e}", fix="nothing to undo") from None
    back: dict[str, list[str]] = {}
    for n in kube.list(node_path()).get("items") or []:
        v = m.NodeView.from_node(n)
        prev = (n["metadata"].get("annotations") or {}).get(m.A_PREVIOUS) or ""
        if not v.in_rollout(r) or not prev or v.driver is None or prev.split("/")[0] == v.driver:
            continue
        host = v.labels.get("kubernetes.io/hostname")
        if not host:
            raise UsageError(f"node {v.name} has no kubernetes.io/hostname label", fix="label it, or start a "
                             "rollout for it by hand")
        back.setdefault(prev, []).append(host)
    if not back:
        raise UsageError(f"no node of rollout {r.name} runs a driver other than the one before it",
                         fix="nothing to undo (see `kubectl driverd rollout status " + r.name + "`)")
    spec = obj.get("spec") or {}
    made = []
    for prev, hosts in sorted(back.items()):
        version, _, flavor = prev.partition("/")
        name = f"{r.name}-undo-{version.replace('.', '-')}"
        new = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": name},
               "spec": {k: v for k, v in spec.items() if k in ("maxParallel", "maxUnavailable", "drain", "waitForJobs",
                                                               "validation", "failureBudget", "preflight")}
               | {"driver": version, "flavor": flavor or "auto",
                  "nodeSelector": {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                                          "values": sorted(hosts)}]}}}
        try:
            if args.dry_run != "client":
                kube.create(rollout_path(), new, dry_run=args.dry_run == "server")
        except KubeError as e:
            if e.status == 409:
                raise UsageError(f"a rollout named {name} already exists", fix=f"delete it first: kubectl "
                                 f"driverd rollout delete {name}") from None
            raise
        # a dry run shows the object it would create, as kubectl's --dry-run -o yaml does
        made.append({"rollout": name, "driver": prev, "nodes": sorted(hosts)}
                    | ({"object": new} if args.dry_run != "none" else {}))
    _print(args, {"created": made, "dryRun": args.dry_run}, "\n".join(
        f"{_rollout_name(d['rollout'])} created{dry_said(args)}: back to {d['driver']} on {len(d['nodes'])} node(s)"
        for d in made), names=[_rollout_name(d["rollout"]) for d in made])
    return 0


def cmd_node(ctx, args) -> int:
    from driverd.cluster import model as m
    from driverd.cluster.kube import KubeError, node_path
    from driverd.errors import UsageError
    kube = _kube(args)
    ann = {"retry": {m.A_RETRY: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
           "skip": {m.A_SKIP: "true"}, "unskip": {m.A_SKIP: None}}[args.verb]
    if args.verb == "retry":
        node = kube.find(node_path(args.node))
        if node is None:
            raise UsageError(f"no node named {args.node}", fix="kubectl driverd nodes")
        if (node["metadata"].get("annotations") or {}).get(m.A_STATE) != m.FAILED:
            raise UsageError(f"node {args.node} has not failed (state "
                             f"{(node['metadata'].get('annotations') or {}).get(m.A_STATE, m.IDLE)})",
                             fix="only failed nodes are retried")
    patch = {"metadata": {"annotations": ann}}
    try:
        if args.dry_run == "client":
            if kube.find(node_path(args.node)) is None:
                raise UsageError(f"no node named {args.node}", fix="kubectl driverd nodes")
            new = {"patch": patch, "node": args.node}
        else:
            new = kube.patch(node_path(args.node), patch, dry_run=args.dry_run == "server")
    except KubeError as e:
        if e.not_found:
            raise UsageError(f"no node named {args.node}", fix="kubectl driverd nodes") from None
        raise
    _print(args, new, f"node/{args.node} {args.verb} requested{dry_said(args)}", names=[f"node/{args.node}"])
    return 0


def cmd_nodes(ctx, args) -> int:
    kube = _kube(args)
    return watching(args, lambda: _nodes(kube, args))


def _nodes(kube, args) -> int:
    from driverd.cli.output import table
    from driverd.cluster import model as m
    from driverd.cluster.kube import node_path
    views = sorted((m.NodeView.from_node(n) for n in kube.list(node_path(), labels=args.selector or None)
                    .get("items") or []), key=lambda v: v.name)
    data = [{"node": v.name, "driver": v.driver, "flavor": v.flavor, "state": v.state, "rollout": v.rollout,
             "reason": v.reason, "message": v.message, "since": v.since, "ready": v.ready,
             "unschedulable": v.unschedulable, "skip": v.skip, "waiting": v.waiting} for v in views]

    def state(d: dict) -> str:
        return d["state"] + (" (skip)" if d["skip"] else "") + (" (waiting for a rollout)" if d["waiting"] else "")
    rows = [["NODE", "DRIVER", "FLAVOR", "STATE", "REASON", "SINCE"]] + [
        [d["node"], d["driver"] or "-", d["flavor"] or "-", state(d), d["reason"] or "-", d["since"] or "-"]
        for d in data]
    wide = [["NODE", "DRIVER", "FLAVOR", "STATE", "REASON", "SINCE", "ROLLOUT", "READY", "SCHEDULABLE", "MESSAGE",
             "WAITING"]] + [
        [d["node"], d["driver"] or "-", d["flavor"] or "-", state(d),
         d["reason"] or "-", d["since"] or "-", d["rollout"] or "-",
         {True: "True", False: "False"}.get(d["ready"], "Unknown"), "no" if d["unschedulable"] else "yes",
         " ".join((d["message"] or "-").split()), d["waiting"] or "-"] for d in data]
    _print(args, {"nodes": data}, table(_cells(rows)), wide=table(_cells(wide)),
           names=[f"node/{_shown(d['node'])}" for d in data])
    return 0


def _target(args):
    """The API as the command line names it (--kubeconfig, --context), else None: the configuration's."""
    from driverd.cluster.kube import Target
    return Target(kubeconfig=args.kubeconfig, context=args.context) if args.kubeconfig or args.context else None


def cmd_agent(ctx, args) -> int:
    from driverd import log as logs
    from driverd.daemon.cluster_mode import ClusterMode, until_terminated
    logs.configure(mode="cluster-agent", timestamps=not logs.stderr_is_journal())   # a long-running process
    cm = ClusterMode(ctx.config, ctx.root, lambda c: ctx.step_context(c), logs.log, target=_target(args),
                     node=args.node, namespace=args.namespace)
    return until_terminated(cm.start, cm.close)


def cmd_coordinator(ctx, args) -> int:
    from driverd import log as logs
    from driverd.daemon.coordinator_service import serve
    logs.configure(mode="cluster-coordinator", timestamps=not logs.stderr_is_journal())
    return serve(ctx.config, ctx.root, target=_target(args), identity=args.identity, namespace=args.namespace,
                 listen=args.listen, log=logs.log)
