"""The one crash-safe engine that changes a part of the driver on a host: the kernel half (modules and
firmware per kernel release, install/modules.py) and the user-space half (install/userspace.py) — and
whatever part comes next — each supply only where they live and how a tree of theirs is made current
and checked (a `Part`); the protocol is here, once:

    1. the target is complete before anything names it (kept by sha256, or unpacked into a tree that is
       renamed into place): a refused install (disk full, read-only, a bad package) changes nothing;
    2. the part prepares what it can before the switch (staging, keeping what it replaces); a failure
       here takes back everything prepared and added;
    3. the pending marker names the target and what it replaces (atomic, fsync'd);
    4. the part makes the target current, then settles it (depmod and modprobe's resolution; the loader
       cache): when a check fails, what it replaced is switched back in the same way and the switch
       fails naming the check — unless it was a repair of the current tree, which stays;
    5. the previous record ({"sha256": replaced, "replaced_by": target, "at"}) is written when asked and
       the marker removed: only now is the switch complete.

A process killed anywhere leaves the marker or a finished switch. `recover()` (run first by every install,
restore and rollback) removes the part's leftovers, then drives a marker to its target (complete since
step 1) through the same checks, or, when the target is gone, back to what it replaced; when neither is
there it settles on what is current. Every write goes through the part's Root (driverd.root)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import field
from datetime import UTC, datetime
from typing import Any, Callable, Protocol

from driverd.datatypes import dataclass
from driverd.driver.records import read_json, valid_sha
from driverd.errors import DriverdError, PackageError
from driverd.install.kept import Additions
from driverd.root import Root
from driverd.runner import Runner


class Entry(Protocol):
    """A complete tree of a part, found by its package's sha256."""
    sha: str

    @property
    def version(self) -> str | None: ...


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Current:
    """What the part has installed now."""
    exists: bool
    sha: str | None = None
    intact: bool = False


@dataclass
class Switch:
    """One switch as its pending marker records it."""
    target: Any                       # an Entry, or None: no tree of this part
    replaced: str | None              # sha256 of what it replaces (what a failed check switches back to)
    set_previous: bool
    verify: bool
    extra: dict = field(default_factory=dict)     # the part's own fields of the marker

    @property
    def want(self) -> str | None:
        return self.target.sha if self.target is not None else None


@dataclass
class Done:
    """The outcome of one switch by the install store: whether anything changed and what it replaced."""
    changed: bool
    replaced: str | None
    settled: Any = None               # what the part's settle() returned (depmod's output and resolution, ...)
    notes: list[str] = field(default_factory=list)


class Part(ABC):
    """Where one part of the driver lives and how a tree of it is made current and checked."""
    root: Root
    runner: Runner
    marker: str                       # host path of the pending marker
    previous: str                     # host path of the previous record

    @abstractmethod
    def current(self) -> Current: ...

    @abstractmethod
    def lookup(self, sha: str) -> Entry | None:
        """The complete tree of package `sha`, when it is there."""

    def installed(self, sha: str | None) -> bool:
        """`sha` (None: nothing of this part) is what is installed, intact, with no switch pending."""
        if self.root.lexists(self.marker):
            return False
        cur = self.current()
        return not cur.exists if sha is None else cur.intact and cur.sha == sha

    def prepare(self, sw: Switch, adds: Additions) -> Any:
        """Before the marker: what can be readied without changing what is in use (staging, keeping
        what is replaced). Must leave nothing of its own behind when it raises."""
        return None

    def discard(self, prepared: Any) -> None:
        """Take back what prepare() made, when the switch stops before its marker."""

    @abstractmethod
    def make_current(self, sw: Switch, prepared: Any) -> tuple[bool, list[str]]:
        """After the marker: make sw.target what is in use. Returns (changed, notes)."""

    def settle(self, sw: Switch, prepared: Any) -> Any:
        """After make_current: what the switched state needs (depmod, the loader cache) and, when
        sw.verify, its checks; a failed check raises DriverdError."""
        return None

    def back_extra(self, sw: Switch, prepared: Any) -> dict:
        """The marker fields of the switch back after a failed check."""
        return {}

    def resumed(self, marker: dict) -> dict:
        """The part's own fields of a marker read back by recover()."""
        return {}

    def clean(self, notes: list[str]) -> None:
        """Remove what a killed process left beside the trees (staging, half-removed trees)."""

    def idle(self, notes: list[str]) -> None:
        """recover() with no switch pending (a link /run lost at a reboot, say)."""

    def prune(self) -> list[str]:
        return []

    @abstractmethod
    def describe(self, entry: Entry | None, *, again: bool) -> str:
        """What is in use after a failed check: 'package 1a2b3c is installed again' (again: switched
        back to it), 'the 550.163.01 user-space stays current' (not: a repair of the tree in use)."""

    @abstractmethod
    def switch_to(self, sha: str | None, entry: Entry | None) -> str:
        """A switch as the notes name it: 'switch of kernel 6.1.0-47-amd64 to package 1a2b3c'."""

    def interrupted(self, sw: Switch, e: OSError) -> Exception | None:
        """The error for a switch an OSError stopped after its marker (None: the OSError itself)."""
        return None

    def refused(self, e: OSError) -> Exception | None:
        """The error for an OSError before the marker, when nothing was changed (None: the OSError)."""
        return None

    # what the messages name
    noun: str = "package"
    gone: str = "it is not there any more"            # a marker's target, when recover() finds it gone
    again_fix: str = "run the command again"


class Store:
    """The protocol of the module docstring, over one Part."""

    def __init__(self, part: Part) -> None:
        self.part = part
        self.root = part.root

    # -- the switch ------------------------------------------------------------------------------------

    def switch(self, target: Entry | None, *, replaced: str | None, set_previous: bool, verify: bool = True,
               extra: dict | None = None, adds: Additions | None = None) -> Done:
        p, root = self.part, self.root
        sw = Switch(target, replaced, set_previous, verify, dict(extra or {}))
        adds = adds if adds is not None else Additions(root)
        prepared = None
        try:
            prepared = p.prepare(sw, adds)
            root.atomic_write_json(p.marker, {"target": sw.want, "replaced": replaced, "set_previous": set_previous,
                                              "verify": verify, **sw.extra, "started_at": now()})
        except BaseException as e:
            p.discard(prepared)
            adds.undo()
            if isinstance(e, OSError) and (err := p.refused(e)) is not None:
                raise err from None
            raise
        try:
            changed, notes = p.make_current(sw, prepared)
            try:
                settled = p.settle(sw, prepared)
            except DriverdError as e:
                if not verify:
                    raise
                self._switch_back(sw, prepared, adds, e)
        except OSError as e:
            raise self._interrupted(sw, e) from None
        try:
            if set_previous and replaced != sw.want:
                root.atomic_write_json(p.previous, {"sha256": replaced, "replaced_by": sw.want, "at": now()})
            root.unlink(p.marker)
        except OSError as e:
            raise self._interrupted(sw, e) from None
        return Done(changed, replaced, settled, notes)

    def _interrupted(self, sw: Switch, e: OSError) -> BaseException:
        return self.part.interrupted(sw, e) or e

    def _switch_back(self, sw: Switch, prepared: Any, adds: Additions, e: DriverdError) -> None:
        """A check of the switched state failed: what it replaced goes back (always raises)."""
        p = self.part
        if sw.replaced == sw.want and sw.want is not None:
            # a repair of the tree in use: there is nothing else to switch back to
            self.root.unlink(p.marker)
            raise PackageError(f"{e.message}; {p.describe(sw.target, again=False)}", cause=e.cause, fix=e.fix) from None
        back = p.lookup(sw.replaced) if sw.replaced and sw.replaced != sw.want else None
        try:
            self.switch(back, replaced=sw.replaced, set_previous=False, verify=False,
                        extra=p.back_extra(sw, prepared))
        except (OSError, DriverdError) as e2:
            raise PackageError(f"{e.message}; switching back failed too: {getattr(e2, 'message', None) or e2}",
                               cause=e.cause, fix=f"{p.again_fix} (the switch is recorded in {p.marker})") from None
        adds.undo(keep={back.sha} if back else set())
        raise PackageError(f"{e.message}; {p.describe(back, again=True)}", cause=e.cause, fix=e.fix) from None

    # -- recovery --------------------------------------------------------------------------------------

    def recover(self) -> list[str]:
        """Finish what an interrupted switch left (module docstring). Writes nothing when there is nothing
        to do, or on a dry-run runner."""
        p = self.part
        notes: list[str] = []
        marker = read_json(self.root, p.marker)
        if p.runner.dry_run:
            if marker is not None:
                notes.append(f"would finish the interrupted {p.noun} switch to {marker.get('target')}")
            return notes
        p.clean(notes)            # first: nothing may see a leftover tree (what it held is kept by now)
        if marker is None:
            p.idle(notes)
            return notes
        target = marker.get("target") if valid_sha(marker.get("target")) else None
        replaced = marker.get("replaced") if valid_sha(marker.get("replaced")) else None
        set_previous, verify = bool(marker.get("set_previous")), bool(marker.get("verify", True))
        if not marker:                             # unreadable: settle on what is installed
            cur = p.current()
            target, replaced, set_previous, verify = (cur.sha if cur.intact else None), None, False, False
        extra = p.resumed(marker)
        entry = p.lookup(target) if target else None
        if target is None or entry is not None:
            try:
                self.switch(entry, replaced=replaced, set_previous=set_previous, verify=verify, extra=extra)
                notes.append(f"finished the interrupted {p.switch_to(target, entry)}")
            except PackageError as e:
                notes.append(f"the interrupted {p.switch_to(target, entry)} failed its checks and was undone: "
                             f"{e.message}")
            return notes
        back = p.lookup(replaced) if replaced else None
        if replaced and back is None:
            # neither tree is there any more (removed by hand): what is installed, if intact, stays
            cur = p.current()
            back = p.lookup(cur.sha) if cur.intact and cur.sha else None
        self.switch(back, replaced=replaced, set_previous=False, verify=False, extra=p.back_extra(
            Switch(None, replaced, False, False, extra), None))
        notes.append(f"undid the interrupted {p.switch_to(target, None)} ({p.gone})")
        return notes

    # -- install, restore, rollback ---------------------------------------------------------------------

    def install(self, sha: str, unpack: Callable[[Additions], Entry]) -> tuple[Entry | None, Done | None, list[str]]:
        """Make package `sha` current: its tree found by sha, else made by `unpack` (complete or absent).
        (entry, None, notes) when it was so already."""
        notes = self.recover()
        p = self.part
        if p.installed(sha):
            return p.lookup(sha), None, notes
        adds = Additions(self.root)
        target = p.lookup(sha)
        if target is None:
            try:
                target = unpack(adds)
            except BaseException as e:
                adds.undo()
                if isinstance(e, OSError) and (err := p.refused(e)) is not None:
                    raise err from None
                raise
        cur = p.current()
        done = self.switch(target, replaced=cur.sha if cur.intact else None, set_previous=True, adds=adds)
        done.notes += p.prune()
        return target, done, notes

    def restore(self, target: Entry | None) -> Done:
        """Switch to `target` (already looked up; None: nothing of this part), recording what it replaces."""
        cur = self.part.current()
        done = self.switch(target, replaced=cur.sha if cur.intact else None, set_previous=True)
        done.notes += self.part.prune()
        return done

    def previous(self) -> tuple[bool, str | None]:
        """(known, sha256) of what the last install/restore replaced (None: nothing of this part then)."""
        rec = read_json(self.root, self.part.previous)
        if not rec or "sha256" not in rec:
            return False, None
        return True, rec["sha256"] if valid_sha(rec["sha256"]) else None

    def record_previous(self, sha: str | None) -> None:
        """Record `sha` (None: nothing) as what was replaced, by nobody known: an older driverd's record."""
        self.put_previous({"sha256": sha, "replaced_by": None, "at": now()})

    def put_previous(self, rec: dict | None) -> None:
        """Make the previous record `rec` again (None: none): a failed run's rollback, after its restore,
        so that the package it failed with is not what `driverd rollback` goes back to."""
        if rec is None:
            self.root.unlink(self.part.previous)
        else:
            self.root.makedirs(self.part.previous.rpartition("/")[0])
            self.root.atomic_write_json(self.part.previous, rec)
