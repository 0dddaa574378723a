"""One package operation in its own process, for the crash tests (run under tests/faults' injector).

    python pkgop.py ROOT install PACKAGE          driverd.install.modules.install
    python pkgop.py ROOT restore RELEASE SHA|-    restore (- : no package)
    python pkgop.py ROOT rollback RELEASE         rollback_install
    python pkgop.py ROOT us-install PACKAGE       driverd.install.userspace.install
    python pkgop.py ROOT us-restore SHA|-         its restore (- : no user-space)
    python pkgop.py --serve                       a fork server (below)

Prints one JSON line: {"ok": true, ...} or {"ok": false, "error": one line, "type": class name}.
Imports only what the call needs (driverd.install.modules and its dependencies).

--serve (started with FAULTS_ARMED=1) imports driverd once, then reads one JSON request per line on
stdin, {"argv": [ROOT, OP, ...], "env": {"FAULTS_KILL_AFTER": "7"}}, and runs each in a forked child
that sets `env`, re-reads the injector's settings and performs the operation: a new process each
time (it shares nothing with the others but the imported code), without paying ~0.3 s of Python
start-up and imports per operation. Answers {"returncode": exit status or -signal, "stdout": ...}.
"""
from __future__ import annotations

import json
import os
import sys


def run(argv: list[str]) -> dict:
    from driverd.errors import DriverdError
    from driverd.install import modules as inst
    from driverd.runner import Runner
    root, op, args = argv[0], argv[1], argv[2:]
    if op.startswith("us-"):
        return run_userspace(root, op, args)
    try:
        if op == "install":
            rep = inst.install(root, args[0], Runner())
        elif op == "restore":
            rep = inst.restore(root, args[0], None if args[1] == "-" else args[1], Runner())
        elif op == "rollback":
            rep = inst.rollback_install(root, args[0], Runner())
        else:
            raise SystemExit(f"unknown op {op}")
    except DriverdError as e:
        return {"ok": False, "error": e.one_line(), "type": type(e).__name__}
    return {"ok": True, "changed": rep.changed, "sha256": rep.sha256, "notes": rep.notes}


def run_userspace(root: str, op: str, args: list[str]) -> dict:
    from driverd.errors import DriverdError
    from driverd.install import userspace as ui
    from driverd.runner import Runner
    try:
        if op == "us-install":
            rep = ui.install(root, args[0], Runner())
        elif op == "us-restore":
            rep = ui.restore(root, None if args[0] == "-" else args[0], Runner())
        else:
            raise SystemExit(f"unknown op {op}")
    except DriverdError as e:
        return {"ok": False, "error": e.one_line(), "type": type(e).__name__}
    return {"ok": True, "changed": rep.changed, "sha256": rep.sha256, "notes": rep.notes}


def serve() -> int:
    import sh  # noqa: F401
    import zstandard  # noqa: F401

    import driverd.install.modules
    import driverd.install.userspace  # noqa: F401
    import driverd.runner
    assert driverd.runner
    for line in sys.stdin:
        req = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:                                         # the child: one operation, then _exit
            os.close(r)
            code = 0
            try:
                os.environ.update(req.get("env") or {})
                faults = sys.modules.get("sitecustomize")
                if faults is not None and hasattr(faults, "configure_from_env"):
                    faults.configure_from_env()
                data = json.dumps(run(req["argv"])) + "\n"
                with os.fdopen(w, "w") as f:                 # a file object: not an injected os.write
                    f.write(data)
            except BaseException as e:                       # noqa: BLE001 - reported, then exit 1
                import traceback
                traceback.print_exc()
                code = 1 if not isinstance(e, SystemExit) else 2
            finally:
                os._exit(code)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sys.stdout.write(json.dumps({"returncode": rc, "stdout": b"".join(chunks).decode()}) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve()
    print(json.dumps(run(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
