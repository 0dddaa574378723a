"""`kubectl driverd pools`, `pool status NAME`, and the DriverPool side of `rollout start --pool` and
`rollout undo`: a pool's desired driver is declarative (the coordinator keeps the pool's nodes on it),
and these imperative verbs set it. What a pool's status says is computed here with the same pure
functions the coordinator writes it with (cluster/pools.py), from the nodes, pools and rollouts as
the API shows them now."""
from __future__ import annotations

import time

from driverd.cli.kubeprint import add_watch, dry_said, watching


def register(sub, common, kube_args, kube_of, emit) -> None:
    """kube_args adds the cluster-access flags, kube_of(args) is the client, emit(args, data, human)
    prints: cluster_cmds' (passed in, not imported: it imports this module)."""
    p = sub.add_parser("pools", parents=[common], help="per DriverPool: desired driver, nodes on it, nodes behind "
                       "and why; and the nodes in no pool",
                       description="Every DriverPool: its desired driver, how many of its nodes run it, each node "
                       "behind and why (joining, upgrading in the pool's rollout, failed, refused by the preflight, "
                       "skipped, NotReady, also selected by another pool), its current rollout and its conditions; "
                       "then the nodes in no pool.")
    add_watch(p, "the pools")
    kube_args(p)
    p.set_defaults(handler=cmd_pools, kube_of=kube_of, emit=emit)
    g = sub.add_parser("pool", help="one DriverPool's nodes")
    gsub = g.add_subparsers(dest="pool_command", metavar="COMMAND")
    p = gsub.add_parser("status", parents=[common], help="a pool's nodes: driver, state, and why each is behind",
                        description="One DriverPool: its desired driver and policy, its current rollout, and every "
                        "node it selects with the driver it runs and, when that is not the pool's, why.")
    p.add_argument("name")
    add_watch(p, "the pool")
    kube_args(p)
    p.set_defaults(handler=cmd_pool_status, kube_of=kube_of, emit=emit)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pools_doc(pool_objs: list[dict], nodes: list[dict], rollouts: list[dict]) -> dict:
    from driverd.cluster import model as m
    from driverd.cluster import pools as pl
    good, bad = pl.read(pool_objs)
    views = sorted((m.NodeView.from_node(n) for n in nodes), key=lambda v: v.name)
    a = pl.assign(good, views)
    out = []
    for p in good:
        cur = pl.current_rollout(p, rollouts)
        st = pl.status(p, a, cur, now=_now(), previous=p.obj.get("status"))
        behind = {b["node"]: b["reason"] for b in st["behindNodes"]}
        selected = [v for v in views if p.selects(v.labels)]
        out.append({"pool": p.name, "driver": p.version, "flavor": p.flavor,
                    "selector": p.spec.label_selector() or "(every node)",
                    "rollout": st["rollout"], "rolloutPhase": ((cur or {}).get("status") or {}).get("phase", ""),
                    "nodes": st["nodes"], "behindNodes": st["behindNodes"], "conditions": st["conditions"],
                    "members": [{"node": v.name, "driver": v.driver, "flavor": v.flavor, "state": v.state,
                                 "current": v.name not in behind, "reason": behind.get(v.name, "")}
                                for v in selected]})
    out += [{"pool": name, "invalid": why} for name, why in sorted(bad.items())]
    drivers: dict[str, int] = {}
    for v in a.free:
        drivers[v.driver or "(none)"] = drivers.get(v.driver or "(none)", 0) + 1
    return {"pools": out, "noPool": {"nodes": [v.name for v in a.free], "drivers": drivers}}


def _human_pools(d: dict) -> str:
    from driverd.cli.output import table
    rows = [["POOL", "DRIVER", "NODES", "CURRENT", "BEHIND", "ROLLOUT", "CONVERGED", "OVERLAP"]]
    notes = []
    for p in d["pools"]:
        if "invalid" in p:
            rows.append([p["pool"], "-", "-", "-", "-", "-", "Invalid", "-"])
            notes.append(f"  {p['pool']}: {p['invalid']}")
            continue
        cond = {c["type"]: c for c in p["conditions"]}
        rows.append([p["pool"], f"{p['driver']} ({p['flavor']})", str(p["nodes"]["total"]), str(p["nodes"]["current"]),
                     str(p["nodes"]["behind"]), (p["rollout"] + (f" ({p['rolloutPhase']})" if p["rolloutPhase"] else ""))
                     or "-", cond["Converged"]["status"], cond["Overlap"]["status"]])
        notes += [f"  {p['pool']}: {b['node']}: {b['reason']}" for b in p["behindNodes"][:10]]
        if cond["Overlap"]["status"] == "True":
            notes.append(f"  {p['pool']}: {cond['Overlap']['message']}")
    free = d["noPool"]
    tail = (f"\nin no pool: {len(free['nodes'])} node(s) (" + ", ".join(f"{k}: {n}" for k, n in sorted(free["drivers"]
            .items())) + "): each keeps its driver; driver.version of its configuration applies only to a joining "
            "node; `kubectl driverd rollout start --driver V --selector ...` upgrades them") if free["nodes"] else ""
    return table(rows) + ("\n" + "\n".join(notes) if notes else "") + tail


def _read(kube) -> tuple[list[dict], list[dict], list[dict]]:
    from driverd.cluster.kube import KubeError, node_path, pool_path, rollout_path
    from driverd.errors import UsageError
    try:
        pools = kube.list(pool_path()).get("items") or []
    except KubeError as e:
        if e.status == 404:
            raise UsageError("the DriverPool resource is not installed in this cluster",
                             fix="kubectl apply -k deploy/base (it holds the CRD)") from None
        raise
    return pools, kube.list(node_path()).get("items") or [], kube.list(rollout_path()).get("items") or []


def cmd_pools(ctx, args) -> int:
    kube = args.kube_of(args)
    return watching(args, lambda: args.emit(args, pools_doc(*_read(kube)), _human_pools))


def cmd_pool_status(ctx, args) -> int:
    kube = args.kube_of(args)
    return watching(args, lambda: _pool_status(kube, args))


def _pool_status(kube, args) -> int:
    from driverd.cli.output import table
    from driverd.errors import UsageError
    _print = args.emit
    pools, nodes, rollouts = _read(kube)
    d = pools_doc([p for p in pools if p["metadata"]["name"] == args.name], nodes, rollouts)
    if not d["pools"]:
        raise UsageError(f"no DriverPool named {args.name}", fix="list them with `kubectl driverd pools`")
    p = d["pools"][0]
    if "invalid" in p:
        _print(args, p, f"pool {p['pool']}: invalid: {p['invalid']}")
        return 3

    def human(p: dict) -> str:
        cond = {c["type"]: c for c in p["conditions"]}
        head = (f"pool {p['pool']}: driver {p['driver']} ({p['flavor']}) on {p['selector']}; rollout "
                f"{p['rollout'] or '-'}" + (f" ({p['rolloutPhase']})" if p["rolloutPhase"] else "") +
                f"\n  {p['nodes']['current']}/{p['nodes']['total']} on it, {p['nodes']['behind']} behind"
                + "".join(f"\n  {c['type']}={c['status']} ({c['reason']}): {c['message']}" for c in cond.values()))
        rows = [["NODE", "DRIVER", "STATE", "ON IT", "WHY NOT"]] + [
            [n["node"], f"{n['driver']}/{n['flavor']}" if n["driver"] else "-", n["state"], "yes" if n["current"] else "no",
             n["reason"][:120] or "-"] for n in p["members"]]
        return head + "\n" + table(rows)
    _print(args, p, human)
    return 0


# -- rollout start --pool / rollout undo of a pool's rollout ---------------------------------------------
POLICY_FLAGS = (("max_parallel", "maxParallel"), ("max_unavailable", "maxUnavailable"), ("canary", "canary"),
                ("canary_soak", "canarySoakSeconds"), ("failure_budget", "failureBudget"),
                ("preflight", "preflight"))


def validation_flags(args) -> dict | None:
    """spec.validation as the --validation-pod-* flags give it (None: none given)."""
    from driverd.errors import UsageError
    image, command, timeout = (getattr(args, k, None) for k in (
        "validation_pod_image", "validation_pod_command", "validation_pod_timeout"))
    if image is None and command is None and timeout is None:
        return None
    if not image:
        raise UsageError("--validation-pod-command and --validation-pod-timeout describe the validation workload pod "
                         "--validation-pod-image names", fix="add --validation-pod-image IMAGE")
    pod: dict = {"image": image}
    if command is not None:
        import shlex
        try:
            pod["command"] = shlex.split(command)
        except ValueError as e:
            raise UsageError(f"--validation-pod-command: {e}", fix="quote it as a shell would") from None
    if timeout is not None:
        pod["timeoutSeconds"] = timeout
    return {"workloadPod": pod}


def start(kube_of, args, labels: dict, exprs: tuple, mu, _print) -> int:
    """`rollout start --pool NAME --driver V`: the pool's desired driver becomes V (and the policy flags
    given become its policy); the coordinator starts the pool's next rollout. With --selector and no
    such pool, the pool is created. `--dry-run=client` contacts no cluster: it prints the pool as
    --selector and the flags make it (for a GitOps repository)."""
    from driverd.cluster import pools as pl
    from driverd.cluster.kube import KubeError, pool_path
    from driverd.errors import UsageError
    given = {key: getattr(args, attr) for attr, key in POLICY_FLAGS if getattr(args, attr) is not None}
    if "maxUnavailable" in given:
        given["maxUnavailable"] = mu
    drain = {k: v for k, v in (("timeoutSeconds", args.drain_timeout), ("force", args.force or None),
                               ("deleteEmptyDirData", args.delete_emptydir_data or None)) if v is not None}
    selector = {k: v for k, v in (("matchLabels", labels), ("matchExpressions", list(exprs))) if v}
    validation = validation_flags(args)
    dry = getattr(args, "dry_run", "none") or "none"        # none | client | server (as kubectl's --dry-run)
    client_only = dry == "client"
    if client_only and not args.selector:
        raise UsageError("--dry-run=client prints a new pool: it needs --selector (the pool's nodes)",
                         fix="add --selector LABELS, or use --dry-run=server for an existing pool")
    kube = None if client_only else kube_of()
    try:
        cur = None if kube is None else kube.find(pool_path(args.pool))
    except KubeError as e:
        if e.status == 404:
            raise UsageError("the DriverPool resource is not installed in this cluster",
                             fix="kubectl apply -k deploy/base (it holds the CRD)") from None
        raise
    if cur is None:
        if not args.selector:
            raise UsageError(f"no DriverPool named {args.pool}", fix=f"create it: add --selector LABELS (its "
                             "nodes), or list the pools with `kubectl driverd pools`")
        spec = {"driver": args.driver, "flavor": args.flavor or "auto", "nodeSelector": selector, **given}
        if drain:
            spec["drain"] = drain
        if args.wait_for_jobs:
            spec["waitForJobs"] = {"podSelector": args.wait_for_jobs}
        if validation:
            spec["validation"] = validation
        obj = {"apiVersion": pl.API_VERSION, "kind": pl.KIND, "metadata": {"name": args.pool}, "spec": spec}
        _valid(obj)
        if dry != "none":           # server: the API server validates and defaults it, storing nothing
            shown = obj if kube is None else kube.create(pool_path(), obj, dry_run=True)
            _print(args, shown, f"driverpool.driverd.io/{args.pool} created ({dry} dry run)")
            return 0
        new = kube.create(pool_path(), obj)
        _print(args, new, f"driverpool.driverd.io/{args.pool} created: driver {args.driver} on {args.selector}; "
               f"the coordinator rolls its nodes to it under the pool's policy; follow it with: kubectl driverd "
               f"pool status {args.pool}")
        return 0
    spec = dict(cur.get("spec") or {})
    if args.selector and selector != (spec.get("nodeSelector") or {}):
        raise UsageError(f"--selector differs from pool {args.pool}'s nodeSelector",
                         fix=f"change a pool's nodes with `kubectl edit driverpool {args.pool}`, or leave --selector out")
    patch = {"driver": args.driver, **given}
    if args.flavor:
        patch["flavor"] = args.flavor
    if drain:
        patch["drain"] = drain
    if args.wait_for_jobs:
        patch["waitForJobs"] = {"podSelector": args.wait_for_jobs}
    if validation:
        # a merge patch: the workload pod's fields given change, the others (and timeoutSeconds) stay
        patch["validation"] = validation
    merged = dict(cur, spec={**spec, **patch})
    if validation:
        old = spec.get("validation") or {}
        merged["spec"]["validation"] = {**old, "workloadPod": {**(old.get("workloadPod") or {}),
                                                               **validation["workloadPod"]}}
    _valid(merged)
    if dry != "none":
        _print(args, merged, f"driverpool.driverd.io/{args.pool} configured ({dry} dry run): driver {args.driver}")
        return 0
    new = kube.patch(pool_path(args.pool), {"metadata": {"resourceVersion": cur["metadata"]["resourceVersion"]},
                                             "spec": patch})
    was = spec.get("driver")
    _print(args, new, f"driverpool.driverd.io/{args.pool}: driver {args.driver}" + (f" (was {was})" if was != args.driver
                                                                                  else " (unchanged)")
           + "; the coordinator starts the pool's next rollout under its policy; follow it with: kubectl driverd "
           f"pool status {args.pool}")
    return 0


def _valid(obj: dict) -> None:
    from driverd.cluster import model as m
    from driverd.cluster import pools as pl
    from driverd.errors import UsageError
    try:
        pl.Pool.from_object(dict(obj, metadata=dict(obj.get("metadata") or {}, generation=1)))
    except m.SpecError as e:
        raise UsageError(f"invalid pool: {e}", fix="see `kubectl driverd rollout start --help`") from None


def refuse_pool_members(kube, rollout_obj: dict) -> None:
    """A rollout no pool owns takes only nodes in no pool: refuse one whose selector reaches pool members
    (the pool's driver would be fought over), naming the pools."""
    from driverd.cluster import model as m
    from driverd.cluster import pools as pl
    from driverd.cluster.kube import KubeError, node_path, pool_path
    from driverd.errors import UsageError
    try:
        pools = pl.read(kube.list(pool_path()).get("items") or [])[0]
    except KubeError as e:
        if e.status == 404:
            return                    # no DriverPool resource: no pools
        raise
    if not pools:
        return
    r = m.Rollout.from_object(dict(rollout_obj, metadata={"name": rollout_obj["metadata"]["name"], "generation": 1}))
    hit: dict[str, list[str]] = {}
    for n in kube.list(node_path()).get("items") or []:
        labels = n["metadata"].get("labels") or {}
        if r.selects(labels):
            for p in pl.selecting(pools, labels):
                hit.setdefault(p.name, []).append(n["metadata"]["name"])
    if hit:
        words = "; ".join(f"pool {p}: {', '.join(ns[:3])}" + (f" and {len(ns) - 3} more" if len(ns) > 3 else "")
                          for p, ns in sorted(hit.items()))
        raise UsageError(f"the selector reaches nodes that belong to DriverPools ({words}): a pool's nodes follow "
                         "the pool's driver", fix="set the pool's driver instead: kubectl driverd rollout start "
                         f"--pool {sorted(hit)[0]} --driver {r.driver} (or narrow --selector to nodes in no pool)")


def undo(kube, args, obj: dict, _print) -> int:
    """`rollout undo` of a pool's rollout: the pool's driver goes back to what it was before that
    revision — the driver of the pool's latest earlier revision that installed another one, else the
    driver the revision's nodes ran before (driverd.io/previous-driver, when they agree)."""
    from driverd.cluster import model as m
    from driverd.cluster import pools as pl
    from driverd.cluster.kube import node_path, pool_path, rollout_path
    from driverd.errors import UsageError
    name, uid = pl.owner(obj)
    pool = kube.find(pool_path(name))
    if pool is None or pool["metadata"].get("uid") != uid:
        raise UsageError(f"rollout {obj['metadata']['name']} belongs to DriverPool {name}, which no longer exists",
                         fix="nothing to undo through the pool; start a rollout for the nodes by hand")
    spec = obj.get("spec") or {}
    this = (spec.get("driver"), spec.get("flavor") or "auto")
    rev = pl.revision(obj)
    before = [o for o in kube.list(rollout_path()).get("items") or []
              if (pl.owner(o) or ("", ""))[1] == uid and pl.revision(o) < rev]
    prev = None
    for o in sorted(before, key=pl.revision, reverse=True):
        s = o.get("spec") or {}
        if (s.get("driver"), s.get("flavor") or "auto") != this:
            prev = (s.get("driver"), s.get("flavor") or "auto")
            break
    if prev is None:
        r = m.Rollout.from_object(obj)
        seen = {(n["metadata"].get("annotations") or {}).get(m.A_PREVIOUS) for n in kube.list(node_path()).get("items")
                or [] if m.NodeView.from_node(n).in_rollout(r) and (n["metadata"].get("annotations") or {}).get(m.A_PREVIOUS)}
        if len(seen) != 1:
            raise UsageError(f"cannot tell pool {name}'s driver before {obj['metadata']['name']}: " +
                             (f"its nodes ran {', '.join(sorted(seen))} before" if seen else "no earlier revision "
                              "and no node it upgraded"),
                             fix=f"set it: kubectl driverd rollout start --pool {name} --driver V")
        prev = (m.split_driver(seen.pop())[0], pool["spec"].get("flavor") or "auto")   # the pool's flavour stays
    patch = {"metadata": {"resourceVersion": pool["metadata"]["resourceVersion"]},
             "spec": {"driver": prev[0], "flavor": prev[1]}}
    dry = getattr(args, "dry_run", "none")
    new = {"patch": patch} if dry == "client" else kube.patch(pool_path(name), patch, dry_run=dry == "server")
    said = dry_said(args)
    _print(args, {"pool": name, "driver": prev[0], "flavor": prev[1], "undone": obj["metadata"]["name"],
                  "object": new, "dryRun": dry},
           f"driverpool.driverd.io/{name}: driver back to {prev[0]} ({prev[1]}), undoing {obj['metadata']['name']}"
           + (said if dry != "none" else "; the coordinator starts the pool's next rollout; follow it with: "
              f"kubectl driverd pool status {name}"))
    return 0
