"""The fabric manager's configuration across driver versions: NVIDIA ships a fabricmanager.cfg with each
version (KEY=VALUE lines, `#` comments); operators edit it (FABRIC_MODE, LOG_LEVEL, ...). The fabric manager
driverd starts from a companion tree runs with <state.dir>/companions/fabricmanager/fabricmanager.cfg: the
version's own file with the operator's settings carried over — every key whose value in the file in use
differs from the defaults it was made from (the replaced companion's file; for the host's own
/usr/share/nvidia/nvswitch/fabricmanager.cfg, whose defaults are unknown, every key that differs from the new
defaults except file paths, which name the host's install). The plan names what is carried."""
from __future__ import annotations

from driverd.driver.companions import CompanionPlaces, CompanionTree
from driverd.root import Root

HOST_CONFIG = "/usr/share/nvidia/nvswitch/fabricmanager.cfg"
TREE_CONFIG = "etc/fabricmanager.cfg"
NAME = "fabricmanager.cfg"


def parse(text: str | None) -> dict[str, str]:
    out = {}
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, _, v = line.partition("=")
        out[k.strip()] = v.strip()
    return out


def config_path(places: CompanionPlaces) -> str:
    return f"{places.records}/{NAME}"


def in_use(root: Root, places: CompanionPlaces) -> tuple[str | None, str | None]:
    """(host path, text) of the configuration the running fabric manager was started with: driverd's own
    when it wrote one, else the host's."""
    for p in (config_path(places), HOST_CONFIG):
        text = root.read_text(p)
        if text is not None:
            return p, text
    return None, None


def carried(root: Root, places: CompanionPlaces, new: CompanionTree, old: CompanionTree | None) -> tuple[dict, str | None]:
    """The operator's settings to carry into `new`'s configuration, and the file they come from."""
    path, text = in_use(root, places)
    if text is None:
        return {}, None
    now = parse(text)
    new_defaults = parse(root.read_text(f"{places.tree(new.name)}/{TREE_CONFIG}"))
    if path == config_path(places) and old is not None:
        base = parse(root.read_text(f"{places.tree(old.name)}/{TREE_CONFIG}"))
        edits = {k: v for k, v in now.items() if base.get(k) != v}
    else:
        edits = {k: v for k, v in now.items() if new_defaults.get(k) != v and not v.startswith("/")}
    return {k: v for k, v in edits.items() if new_defaults.get(k) != v}, path


def header(tree: CompanionTree) -> str:
    return f"# driverd: the configuration of fabric manager {tree.version} (companion {tree.sha})"


def written_for(root: Root, places: CompanionPlaces, tree: CompanionTree) -> bool:
    """driverd's configuration is there and was written for `tree` (a process killed between the switch and
    the write leaves the previous version's)."""
    text = root.read_text(config_path(places)) or ""
    return text.split("\n", 1)[0] == header(tree)


def render(defaults_text: str, settings: dict[str, str], source: str | None, tree: CompanionTree) -> str:
    """The version's file with `settings` put in place of its own values (keys it lacks appended)."""
    out, seen = [header(tree)], set()
    for line in defaults_text.splitlines():
        k = line.partition("=")[0].strip()
        if "=" in line and not line.lstrip().startswith("#") and k in settings:
            out.append(f"{k}={settings[k]}")
            seen.add(k)
        else:
            out.append(line)
    rest = [k for k in settings if k not in seen]
    if rest:
        out.append(f"# carried by driverd from {source}")
        out += [f"{k}={settings[k]}" for k in rest]
    return "\n".join(out) + "\n"


def write(root: Root, places: CompanionPlaces, new: CompanionTree, old: CompanionTree | None) -> tuple[str, dict]:
    """Write the configuration `new`'s fabric manager starts with; (its host path, the settings carried)."""
    settings, source = carried(root, places, new, old)
    text = render(root.read_text(f"{places.tree(new.name)}/{TREE_CONFIG}") or "", settings, source, new)
    root.makedirs(places.records)
    root.atomic_write(config_path(places), text, 0o644)
    return config_path(places), settings
