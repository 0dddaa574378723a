"""One exception type per subject, each carrying what went wrong, why, and what to do about it.

The CLI prints these on one line (or as JSON) and exits with `exit_code`; they never produce a
traceback. Anything else escaping a command is a bug and exits 1.
"""
from __future__ import annotations

from driverd.redact import redact

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_BLOCKED = 3
EXIT_REBOOT = 4         # everything safe was done; the host must reboot to finish (driverd apply)


class DriverdError(Exception):
    """An expected failure: message (what), cause (why), fix (what the operator should do)."""

    subject = "driverd"
    exit_code = EXIT_UNEXPECTED

    def __init__(self, message: str, *, cause: str | None = None, fix: str | None = None,
                 exit_code: int | None = None, details: dict | None = None) -> None:
        # Messages often quote a repository URL: never with the credentials in it (issue 21).
        message = redact(message)
        super().__init__(message)
        self.message = message
        self.cause = redact(cause) if cause else cause
        self.fix = redact(fix) if fix else fix
        self.details = details or {}
        if exit_code is not None:
            self.exit_code = exit_code

    def one_line(self) -> str:
        parts = [self.message]
        if self.cause:
            parts.append(f"cause: {self.cause}")
        if self.fix:
            parts.append(f"fix: {self.fix}")
        # Every line break str.splitlines() knows (\r, \x0b, \x85, \u2028...), not only \n: a kernel
        # log line or a parser's message quoted here must not start a second line (found by fuzzing).
        return "; ".join(" ".join(p.splitlines()).strip() for p in parts)

    def to_json(self) -> dict:
        out = {"error": self.message, "subject": self.subject, "cause": self.cause, "fix": self.fix,
               "exit_code": self.exit_code}
        if self.details:
            out["details"] = self.details
        return out


class UsageError(DriverdError):
    subject = "usage"
    exit_code = EXIT_USAGE


class ConfigError(DriverdError):
    subject = "config"
    exit_code = EXIT_USAGE


class HostError(DriverdError):
    """A host fact could not be read in a way that makes the whole snapshot meaningless."""
    subject = "host"
    exit_code = EXIT_UNEXPECTED


class HostPathError(HostError):
    """A host path cannot be written inside the root: a symlink loop, too many links, a link where
    driverd must not follow one. driverd writes nothing rather than write somewhere else."""
    subject = "host"
    exit_code = EXIT_BLOCKED


class PlanError(DriverdError):
    """The desired state cannot be reached on this host (e.g. no flavour serves every GPU)."""
    subject = "plan"
    exit_code = EXIT_BLOCKED


class CommandError(DriverdError):
    """An external command failed or could not be run."""
    subject = "command"
    exit_code = EXIT_UNEXPECTED


class PackageError(DriverdError):
    subject = "package"
    exit_code = EXIT_BLOCKED


class ModuleError(DriverdError):
    subject = "module"
    exit_code = EXIT_BLOCKED


class RuntimeConfigError(DriverdError):
    subject = "runtime"
    exit_code = EXIT_BLOCKED


class ClusterError(DriverdError):
    subject = "cluster"
    exit_code = EXIT_BLOCKED


class JournalError(DriverdError):
    subject = "journal"
    exit_code = EXIT_BLOCKED

