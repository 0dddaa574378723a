"""Two CDI specs side by side by what a container gets (tools/gpuproof; never shipped)."""
import sys

import yaml


def paths(f):
    s = yaml.safe_load(open(f))
    e = s.get("containerEdits", {})
    mounts = {x["containerPath"] for x in e.get("mounts", [])}
    nodes = {x["path"] for x in e.get("deviceNodes", [])}
    nodes |= {n["path"] for dv in s["devices"] for n in dv["containerEdits"].get("deviceNodes", [])}
    hooks = {" ".join(x["args"][1:2]) for x in e.get("hooks", [])}
    return mounts, nodes, hooks, {x["name"] for x in s["devices"]}


a, b = paths(sys.argv[1]), paths(sys.argv[2])
for i, what in enumerate(("mounts", "device nodes", "hooks", "device names")):
    print(f"{what}: driverd {len(a[i])}, nvidia-ctk {len(b[i])}; only driverd: {sorted(a[i] - b[i])}; "
          f"only nvidia-ctk: {sorted(b[i] - a[i])}")
