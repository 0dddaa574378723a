"""The validate step: the validation (driverd.apply.validation) as the last step of a run and of its rollback."""
from __future__ import annotations

from driverd.apply.step import StepImpl
from driverd.apply.validation import validate_driver


class Validate(StepImpl):
    action = "validate"

    def do(self, ctx, params):
        return validate_driver(ctx, params)

    def describe(self, params):
        e = params.get("expect")
        return "validate the driver" + (f" ({e[0]} {e[1]})" if e else "")
