"""A reboot the plan needs: recorded durably, with the sentinel reboot coordinators watch, and cleared
after it."""
from __future__ import annotations

import json
import time

from driverd.apply.hostview import boot_id
from driverd.apply.step import StepImpl


REBOOT_RECORD = "reboot-required.json"          # under state.dir
REBOOT_SENTINEL = "/var/run/reboot-required"     # what kured and Ubuntu's update-notifier watch
REBOOT_PKGS = "/var/run/reboot-required.pkgs"


def reboot_record_path(ctx) -> str:
    return f"{ctx.config['state.dir']}/{REBOOT_RECORD}"


def reboot_record(ctx) -> dict | None:
    """The recorded "reboot required" (reasons, since, boot id, whether we raised the sentinel)."""
    text = ctx.root.read_text(reboot_record_path(ctx))
    try:
        rec = json.loads(text) if text else None
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class RequireReboot(StepImpl):
    """Record that the host must reboot to finish (durably, with the reasons) and raise the
    sentinel reboot coordinators watch (/var/run/reboot-required, as Ubuntu and kured use)."""
    action = "require-reboot"

    def check(self, ctx, params):
        rec = reboot_record(ctx)
        return bool(rec) and rec.get("reasons") == params["reasons"] and ctx.root.exists(REBOOT_SENTINEL)

    def do(self, ctx, params):
        created = not ctx.root.exists(REBOOT_SENTINEL)
        if created:
            ctx.root.atomic_write(REBOOT_SENTINEL, "*** System restart required ***\n", 0o644)
        pkgs = ctx.root.read_text(REBOOT_PKGS) or ""
        if "driverd" not in pkgs.split():
            ctx.root.atomic_write(REBOOT_PKGS, pkgs + ("" if not pkgs or pkgs.endswith("\n") else "\n") + "driverd\n",
                                  0o644)
        rec = {"reasons": params["reasons"], "since": time.time(), "boot_id": boot_id(ctx),
               "sentinel_created": created, "target": params.get("target")}
        ctx.root.atomic_write_json(reboot_record_path(ctx), rec, 0o644)
        return rec

    def describe(self, params):
        return "record that a reboot is required (" + "; ".join(params["reasons"]) + ")"


class ClearReboot(StepImpl):
    """After the reboot: forget the record and take our name off the sentinel."""
    action = "clear-reboot"

    def check(self, ctx, params):
        return not ctx.root.exists(reboot_record_path(ctx))

    def do(self, ctx, params):
        rec = reboot_record(ctx) or {}
        pkgs = [p for p in (ctx.root.read_text(REBOOT_PKGS) or "").split() if p != "driverd"]
        if pkgs:
            ctx.root.atomic_write(REBOOT_PKGS, "\n".join(pkgs) + "\n", 0o644)
        else:
            ctx.root.unlink(REBOOT_PKGS)
            if rec.get("sentinel_created"):
                ctx.root.unlink(REBOOT_SENTINEL)
        ctx.root.unlink(reboot_record_path(ctx))
        return {"cleared": rec.get("reasons")}

    def describe(self, params):
        return "clear the reboot-required record"
