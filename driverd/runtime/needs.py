"""What the runtime handler needs on this host, and whether it has it: the verdict `driverd detect`
and `driverd plan` give per runtime.

A handler (runtime.handler, 'nvidia') is a name in a runtime's configuration that runs a binary
(runtime.binary, /usr/bin/nvidia-container-runtime, or what a handler already there names). driverd
configures the handler whether or not that binary exists — nvidia-container-toolkit may well be
installed after driverd —, so detect says, per runtime:
- the binary: which one (the configured handler's own, else runtime.binary), where it resolves under
  the root (a bare name on the host's PATH, where dockerd, CRI-O and runc's shim look it up), and
  whether it is there and executable;
- CDI, the other way to hand GPUs to containers: whether this runtime's version injects CDI devices
  and its configuration in effect turns that on (each runtime's `cdi()`, with its sources), and whether
  a spec of kind nvidia.com/gpu is in the directories it reads;
- one line in operators' words, with the fixes.
Reading only: nothing here raises for a missing or odd file.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

from driverd.root import Root
from driverd.runtime import adopt
from driverd.runtime.model import CDI_KIND, DEFAULT_CDI_SPEC, CdiFacts, HandlerNeeds, RuntimeFacts

TOOLKIT = "nvidia-container-toolkit"
# CDI reads spec files named *.json or *.yaml (cncf-tags/container-device-interface README, "How does
# CDI work?"); a top-level `kind:` line is what driverd's writer (driverd.runtime.cdi) and nvidia-ctk
# put in a YAML spec — detect reads it without a YAML parser (yaml stays off the host commands' path).
SPEC_SUFFIXES = (".json", ".yaml")
_YAML_KIND = re.compile(r"""^kind:[ \t]*(['"]?)(?P<kind>[^'"#\s]+)\1[ \t]*(#.*)?$""", re.M)
# Bounds on what a configuration (read from the host, maybe hostile) can make detect read.
_MAX_SPEC = 1 << 20                      # bytes of one spec file
_MAX_DIRS = 16                           # spec directories looked at
_MAX_SPECS = 64                          # spec files read per directory


def assess(root: Root, rt, facts: RuntimeFacts, handler: str, runtime_binary: str) -> HandlerNeeds:
    """What `handler` needs in the runtime `rt` (a driverd.runtime.base.Runtime) detected as `facts`;
    `runtime_binary` is runtime.binary, what a handler driverd adds runs."""
    configured = handler in facts.handlers
    default = configured and rt.default_runtime(root, facts) == handler
    named = rt.handler_binary(root, facts, handler) if configured else None
    binary, source = (named, "config") if named else (runtime_binary, "runtime.binary")
    path, state = resolve_binary(root, binary)
    cdi = rt.cdi(root, facts)
    cdi = dataclasses.replace(cdi, specs=find_specs(root, cdi.spec_dirs))
    status = ("ok" if configured else "not-configured") if state == "present" else "binary-missing"
    fixes = _fixes(rt.title, handler, binary, path, state, source, cdi) if state != "present" else ()
    return HandlerNeeds(rt.name, handler, configured, default, binary, source, path, state, cdi, status,
                        _verdict(rt, facts, handler, default, binary, path, state, source, fixes),
                        cdi_line(root, rt.title, cdi), fixes,
                        waits_for_binary=rt.checks_binary and not configured and state != "present")


def resolve_binary(root: Root, binary: str) -> tuple[str | None, str]:
    """(host path, present | missing | not-executable): a bare name is looked up on the host's PATH."""
    path = binary if "/" in binary else adopt.lookup(root, binary)
    if path is None or not root.exists(path):
        return path, "missing"
    return path, "present" if root.is_executable(path) else "not-executable"


def spec_kind(text: str | None, name: str) -> str | None:
    """The `kind` a CDI spec file declares (None when unreadable)."""
    if text is None:
        return None
    if name.endswith(".json") or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return None
        kind = doc.get("kind") if isinstance(doc, dict) else None
        return kind if isinstance(kind, str) else None
    m = _YAML_KIND.search(text)
    return m.group("kind") if m else None


def find_specs(root: Root, dirs: tuple[str, ...], kind: str = CDI_KIND) -> tuple[str, ...]:
    """The spec files of `kind` in the spec directories under the root (a directory reached twice,
    /var/run/cdi and /run/cdi through the /var/run link, counts once)."""
    found: list[str] = []
    seen: set[str] = set()
    for d in dirs[:_MAX_DIRS]:
        real = _resolved(root, d)
        if real in seen:
            continue
        seen.add(real)
        names = [n for n in root.listdir(d) if n.endswith(SPEC_SUFFIXES)][:_MAX_SPECS]
        found.extend(p for n in names
                     if spec_kind(root.read_text(p := f"{d.rstrip('/')}/{n}", _MAX_SPEC), n) == kind)
    return tuple(found)


def _resolved(root: Root, path: str) -> str:
    try:
        return root.resolve(path)
    except (OSError, ValueError):
        return path


def cdi_line(root: Root, title: str, cdi: CdiFacts) -> str:
    if cdi.supported is False:
        return f"CDI: not supported ({cdi.evidence})"
    state = {True: "on", False: "off", None: "unknown"}[cdi.enabled]
    spec = (f"spec for {CDI_KIND}: {', '.join(cdi.specs)}" if cdi.specs else
            f"no spec for {CDI_KIND} in {', '.join(cdi.spec_dirs) or 'any directory'}")
    line = f"CDI: {state} ({cdi.evidence}); {spec}"
    ours = _resolved(root, os.path.dirname(DEFAULT_CDI_SPEC))
    if cdi.spec_dirs and ours not in {_resolved(root, d) for d in cdi.spec_dirs}:
        line += f"; driverd writes its spec to {DEFAULT_CDI_SPEC}, a directory {title} does not read"
    return line


def _named(binary: str, path: str | None) -> str:
    return binary if path in (None, binary) else f"{binary} ({path})"


def _fixes(title: str, handler: str, binary: str, path: str | None, state: str, source: str,
           cdi: CdiFacts) -> tuple[str, ...]:
    out = [f"make {path} executable or reinstall {TOOLKIT}" if state == "not-executable" else f"install {TOOLKIT}"]
    out.append("set runtime.binary to the NVIDIA runtime's path" if source == "runtime.binary" else
               f"set runtime.binary and run `driverd runtime configure` to point '{handler}' at an installed runtime")
    if cdi.usable:
        out.append(f"use CDI instead ({title} reads {cdi.specs[0]})")
    elif cdi.supported and cdi.enabled:
        out.append(f"use CDI instead (runtime.cdi = true writes {DEFAULT_CDI_SPEC} once the GPUs are visible)")
    elif cdi.supported:
        out.append(f"use CDI instead (runtime.cdi = true turns it on in {title} and writes {DEFAULT_CDI_SPEC})")
    return tuple(out)


def _verdict(rt, facts: RuntimeFacts, handler: str, default: bool, binary: str, path: str | None, state: str,
             source: str, fixes: tuple[str, ...]) -> str:
    label = f"{rt.title} {facts.version}" if facts.version else f"{rt.title} (version unknown)"
    what = _named(binary, path) + (" (runtime.binary)" if source == "runtime.binary" else "")
    configured = handler in facts.handlers
    if state == "present":
        if configured:
            return f"{label}: handler '{handler}' configured{' as the default' if default else ''}, runs {what}: ready"
        return (f"{label}: handler '{handler}' not configured yet; {what} is present: `driverd apply` or "
                "`driverd runtime configure` adds it")
    bad = "missing" if state == "missing" else "is not an executable file"
    fix = " (fix: " + ", or ".join(fixes) + ")"
    failure = rt.handler_failure.format(handler=handler)
    if default:
        return (f"{label}: handler '{handler}' configured as the default runtime, {what} {bad}: {failure}; as the "
                f"default it also breaks every container that names no runtime{fix}")
    if configured:
        return f"{label}: handler '{handler}' configured, {what} {bad}: {failure}{fix}"
    if rt.checks_binary:
        return (f"{label}: handler '{handler}' not configured, {what} {bad}: driverd adds it only once the binary "
                f"exists ({rt.title} refuses a handler whose binary is missing){fix}")
    return f"{label}: handler '{handler}' not configured, {what} {bad}: once configured, {failure}{fix}"
