"""The container runtimes' steps (configure, revert) and the undo of any step by its preimage: the files
put back byte for byte."""
from __future__ import annotations

from driverd.apply.executor import unb64
from driverd.apply.step import StepImpl
from driverd.apply.steps.common import restore_files_steps


def runtime_options(ctx, params, dry_run: bool = False):
    from driverd.runtime.changes import Options
    opts = dict(params.get("options") or {})
    return Options.from_config(ctx.config, handler=params.get("handler"), dry_run=dry_run or ctx.runner.dry_run,
                               **{k: v for k, v in opts.items() if k != "handler"})


def _runtime_files(ctx, params, verb: str) -> list[str]:
    """The files a configure/revert would write, from a dry run of it (without any restart), plus
    driverd's runtime record and the runtime's main config: what the undo must put back."""
    import dataclasses
    from driverd.runtime import registry
    from driverd.runtime.handler import configure, revert
    from driverd.runtime.state import STATE_FILE, state_file
    from driverd.runner import Runner
    opts = dataclasses.replace(runtime_options(ctx, params, dry_run=True), restart="none")
    files = {state_file(ctx.config["state.dir"]), STATE_FILE}    # the default's: a record moved from there
    if params["runtime"] in registry.names():
        files.add(opts.config_path or registry.get(params["runtime"]).default_config)
    if opts.cdi or params["runtime"] == "cdi":
        files.add(opts.cdi_spec_path)
    fn = configure if verb == "configure" else revert
    try:
        rep = fn(ctx.root, params["runtime"], opts, Runner(dry_run=True))
        files |= set(rep.files_changed) | set(rep.backups)
    except Exception:
        pass                           # do() fails the same way, before it writes anything
    return sorted(files)


class _RuntimeStep(StepImpl):
    """configure/revert one container runtime (driverd.runtime); idempotent by construction: a
    second run writes and restarts nothing. The files it may write are kept in the journal first,
    so a failure after the write (a restart that fails) still puts them back byte for byte."""
    verb = ""

    def _fn(self):
        from driverd.runtime import handler as c
        return c.configure if self.verb == "configure" else c.revert

    def check(self, ctx, params):
        from driverd.runner import Runner
        try:
            rep = self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params, True), Runner(dry_run=True))
        except Exception:
            return False
        return not rep.files_changed

    def preflight(self, ctx, params):
        """A runtime configuration driverd cannot parse is bad input (exit 2), refused before the run
        starts: nothing is journalled, nothing changed, no driver rollback to report."""
        from driverd.errors import EXIT_USAGE, DriverdError
        from driverd.runner import Runner
        try:
            self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params, True), Runner(dry_run=True))
        except DriverdError as e:
            if e.exit_code == EXIT_USAGE:
                raise
        except Exception:
            pass                        # do() meets it again, inside the run, where it is journalled

    def preimage(self, ctx, params):
        return _runtime_files(ctx, params, self.verb)

    def do(self, ctx, params):
        return self._fn()(ctx.root, params["runtime"], runtime_options(ctx, params), ctx.runner).to_json()

    def undo(self, ctx, params, entry):
        if entry["status"] == "done" and not (entry.get("result") or {}).get("files_changed"):
            return []
        return restore_files_steps(entry, [] if params["runtime"] == "cdi" else [params["runtime"]])


class ConfigureRuntime(_RuntimeStep):
    action = "configure-runtime"
    verb = "configure"

    def describe(self, params):
        return f"configure {params.get('runtime')} handler {params.get('handler') or '(configured)'}"


class RevertRuntime(_RuntimeStep):
    action = "revert-runtime"
    verb = "revert"

    def describe(self, params):
        return f"revert driverd's {params.get('runtime')} changes"


class RestoreFiles(StepImpl):
    """Put files back exactly as a step's preimage recorded them (absent ones are removed), then
    restart the runtimes whose configuration that changed. A restart that fails is a warning: the
    files are what the runtime will read when it next starts."""
    action = "restore-files"

    def check(self, ctx, params):
        return all(ctx.root.read_bytes(p, 64 << 20) == unb64(b) for p, b in params["files"].items())

    def do(self, ctx, params):
        changed = []
        for p, b in sorted(params["files"].items()):
            data = unb64(b)
            if ctx.root.read_bytes(p, 64 << 20) == data:
                continue
            if data is None:
                ctx.root.unlink(p)
            else:
                ctx.root.atomic_write(p, data)
            changed.append(p)
        restarted = []
        for rt in params.get("restart") or []:
            if not changed:
                break
            try:
                from driverd.runtime import restart_runtime
                restarted.append(restart_runtime(ctx.root, rt, runtime_options(ctx, {"runtime": rt}), ctx.runner))
            except Exception as e:
                ctx.warn(f"{rt} could not be restarted after its configuration was restored: {e}")
        return {"restored": changed, "restarts": restarted}

    def describe(self, params):
        return "put back " + ", ".join(sorted(params["files"]))
