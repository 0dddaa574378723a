"""What every command gets: the host root, the validated configuration, output mode, the runner."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

from driverd import config as config_mod
from driverd.root import Root
from driverd.runner import Runner


@dataclass
class Context:
    root: Root
    json: bool
    dry_run: bool
    config_path: str | None

    @cached_property
    def config(self) -> config_mod.Config:
        return config_mod.load(self.root, self.config_path)

    @cached_property
    def runner(self) -> Runner:
        return Runner(dry_run=self.dry_run)

    @classmethod
    def from_args(cls, args) -> "Context":
        root = args.root or os.environ.get("DRIVERD_ROOT") or "/"
        return cls(Root(root), bool(args.json), bool(getattr(args, "dry_run", False)), args.config)
