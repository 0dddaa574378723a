"""The daemon's kernel watch (issue 43): a kernel installed behind driverd's back — the post-install hook not
run, or run while the repository was away — gets its driver package in the daemon's next pass, before anyone
reboots into it; a kernel the host no longer has loses what driverd kept for it once the host runs a newer one.

Each pass (`KernelWatch.run`, called by apply.reconcile after the host's own reconcile):
- every installed kernel newer than the running one (driverd.host.kernels) is judged as `driverd
  reboot-ready` judges it (driverd.install.rebootgate); one that lacks the node's driver package is
  prepared — `prepare-kernel`'s transaction: fetched, else built (packages.build_fallback), verified,
  installed into its /lib/modules — when its retry is due;
- a kernel that cannot be prepared is named with the reason and tried again with a backoff per kernel
  (daemon.retry_min_s doubling up to daemon.retry_max_s), never skipped silently; a change of the kernels
  on disk (daemon.kernelwatch) or of the configuration tries again at once;
- kernels older than the running one that are no longer installed lose driverd's kept packages, records
  and leftover tree (`forget-kernels`' transaction; the kept store's own limits still apply to the rest).
The outcome goes into the pass's Result (`kernels`, `retry_in_s`): the metric
driverd_kernel_unprepared{kernel}, `driverd status`, the cluster agent's Events and the loop's next pass."""
from __future__ import annotations

import re
import time
from typing import Callable

from driverd.datatypes import dataclass
from driverd.errors import DriverdError

_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")      # a release name driverd's install accepts


@dataclass
class _Tried:
    """The kernel watch's last failed preparation of one kernel's driver package, and when to try again."""
    attempts: int
    next_at: float          # monotonic
    reason: str


class KernelWatch:
    def __init__(self, log: Callable[..., None], clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.clock = clock
        self.tried: dict[tuple, _Tried] = {}       # (release, version, flavor) -> the last failed preparation
        self.seen: dict[str, bool] = {}            # release -> prepared, as last reported (log on change only)

    def wake(self) -> None:
        """The kernels on disk or the configuration changed: every retry is due now."""
        for t in self.tried.values():
            t.next_at = 0.0

    def run(self, sctx, cfg, lock_wait_s: float, res) -> None:
        """Judge, prepare and clean up (module docstring); the report goes into `res`. Never raises."""
        try:
            self._run(sctx, cfg, lock_wait_s, res)
        except Exception as e:                  # a reader's surprise must not fail the host's pass
            res.warnings.append(f"the kernel watch failed: {e.__class__.__name__}: {e}")

    def _run(self, sctx, cfg, lock_wait_s: float, res) -> None:
        from driverd.host.kernel import running_release
        from driverd.host.kernels import family, installed_kernels, newer_than
        from driverd.install import rebootgate as rg
        root = sctx.root
        running = running_release(root)
        if running is None or cfg["driver.manage"] == "never" or not cfg["driver.version"]:
            return
        fam = family(root)
        kernels = installed_kernels(root, fam)
        self._forget_gone(sctx, cfg, lock_wait_s, res, running, fam, kernels)
        if getattr(res, "left_to", None) or not rg.has_gpus(root):
            return                              # the driver is another package manager's, or there is no GPU
        want = rg.wanted_driver(root, cfg, cfg["driver.version"],
                                cfg["driver.flavor"] if cfg["driver.flavor"] != "auto" else None)
        if want is None or not want.get("flavor"):
            return
        out: dict[str, dict] = {}
        now = self.clock()
        for k in newer_than(kernels, running, fam):
            key = (k.release, want["version"], want["flavor"])
            v = rg.judge_kernel(root, cfg, fam, k, want)
            tried = self.tried.get(key)
            if not v.ready and k.modules and (tried is None or tried.next_at <= now):
                self.log(f"driverd daemon: kernel {k.release} is installed without the {want['version']} "
                         f"({want['flavor']}) driver ({v.short}): preparing it", "info", kernel=k.release)
                why = self._prepare(sctx, cfg, lock_wait_s, res, k.release, want)
                v = rg.judge_kernel(root, cfg, fam, k, want)
                if v.ready:
                    self.tried.pop(key, None)
                else:
                    tried = self._failed(key, cfg, why or f"{v.short}: {'; '.join(v.lacks)}")
            if v.ready:
                self.tried.pop(key, None)
                out[k.release] = {"prepared": True, "package": v.package}
                if self.seen.get(k.release) is False:
                    self.log(f"driverd daemon: kernel {k.release}: the {want['version']} ({want['flavor']}) driver "
                             "is prepared", "info", kernel=k.release)
            else:
                reason = tried.reason if tried is not None and k.modules else f"{v.short}: {'; '.join(v.lacks)}"
                nxt = max(0.0, tried.next_at - self.clock()) if tried is not None and k.modules else None
                out[k.release] = {"prepared": False, "short": v.short, "reason": reason, "fix": v.fix,
                                  "attempts": tried.attempts if tried is not None else 0,
                                  "next_try_in_s": None if nxt is None else round(nxt, 1)}
                if nxt is not None:
                    res.retry_in_s = nxt if res.retry_in_s is None else min(res.retry_in_s, nxt)
            self.seen[k.release] = out[k.release]["prepared"]
        for rel in [r for r in self.seen if r not in out]:
            del self.seen[rel]
        res.kernels = out

    def _prepare(self, sctx, cfg, lock_wait_s: float, res, release: str, want: dict) -> str | None:
        """prepare-kernel's transaction for `release`; None when it ran to its end, else why not."""
        from driverd.apply import lifecycle as lc
        from driverd.host.kernel import read_kernel
        from driverd.repo.fetch import Want
        arch = read_kernel(sctx.root, []).arch or "x86_64"
        w = Want(want["version"], want["flavor"], release, arch)
        try:
            out = lc.transact(sctx, lc.prepare_kernel_request(cfg, w, allow_build=True), wait_s=lock_wait_s)
            _record(sctx, res, out)
            lc.raise_for(out)
        except DriverdError as e:
            return e.one_line()
        return None

    def _failed(self, key: tuple, cfg, reason: str) -> _Tried:
        prev = self.tried.get(key)
        n = (prev.attempts if prev else 0) + 1
        lo = max(1.0, float(cfg["daemon.retry_min_s"]))
        delay = min(max(lo, float(cfg["daemon.retry_max_s"])), lo * 2 ** (n - 1))
        t = self.tried[key] = _Tried(n, self.clock() + delay, reason)
        self.log(f"driverd daemon: kernel {key[0]} could not be prepared (attempt {n}): {reason}; trying again in "
                 f"{delay:.0f}s", "warning", kernel=key[0], retry_in_s=round(delay))
        return t

    def _forget_gone(self, sctx, cfg, lock_wait_s, res, running: str, fam, kernels) -> None:
        """Releases older than the running kernel that are no longer installed but still have driverd's kept
        packages, records or tree: removed in one journalled run."""
        from driverd.apply import lifecycle as lc
        from driverd.install.leftovers import release_leftovers
        installed = {k.release for k in kernels} | {running}
        cands = set(sctx.root.listdir("/lib/modules")) | _kept_releases(sctx.root, cfg["state.dir"])
        gone = []
        for r in sorted(cands):
            if r in installed or not _PLAIN.fullmatch(r) or fam.compare_releases(r, running) >= 0:
                continue
            try:
                if release_leftovers(sctx.root, r, cfg["state.dir"]):
                    gone.append(r)
            except DriverdError:            # a name driverd would not write; nothing of it is driverd's
                continue
        if not gone:
            return
        try:
            out = lc.transact(sctx, lc.forget_kernels_request(gone), wait_s=lock_wait_s)
            _record(sctx, res, out)
            lc.raise_for(out)
            self.log(f"driverd daemon: removed driverd's packages of kernel(s) no longer installed: {', '.join(gone)}",
                     "info", kernels=gone)
        except DriverdError as e:
            res.warnings.append(f"cannot remove the packages of kernels no longer installed ({', '.join(gone)}): "
                                f"{e.one_line()}")


def _kept_releases(root, state_dir: str) -> set[str]:
    from driverd.driver import kept as kp
    out = set()
    for sha in kp.kept_shas(root, state_dir):
        m = kp.tree_manifest(kp.kept_base(root, state_dir) / sha / "modules")
        if m is not None:
            out.add(m.kernel_release)
    return out


def _record(sctx, res, out: dict) -> None:
    """A journalled run this watch made goes into the pass's runs (metrics, the daemon's log)."""
    from driverd.apply import lifecycle as lc
    if out.get("run_id"):
        doc = lc.journal(sctx).load(repair=False)
        if doc and doc.get("run_id") == out["run_id"]:
            res.runs.append(doc)
