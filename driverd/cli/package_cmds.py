"""build, build-userspace, build-companion, build-matrix, repo index, fetch, install, prepare-kernel, rollback-install: the
package commands."""
from __future__ import annotations

import argparse
import os

from driverd.cli.lifecycle_cmds import add_force, add_wait
from driverd.cli.options import Deprecated, add_ccache, add_flavor, add_rebuild, add_work_dir, builds
from driverd.cli.output import emit
from driverd.errors import EXIT_OK, UsageError

F = argparse.RawDescriptionHelpFormatter


def _default_distro(sub, command: str):
    """The default distribution's commands, for `command`'s help: not imported when another command runs."""
    if not builds(sub, command):
        return None
    from driverd import distro
    return distro.DEFAULT


def register(sub, common) -> None:
    d = _default_distro(sub, "build")
    p = sub.add_parser(
        "build", parents=[common], formatter_class=F,
        help="compile the NVIDIA kernel modules for one kernel and pack them as a package",
        description="Compile NVIDIA's kernel modules from a driver source (a kernel-source tarball such as "
        "/usr/src/nvidia-open-kernel.tar.xz, or an unpacked tree) against a kernel's headers with kbuild, read "
        "every module with modinfo, optionally sign each with the kernel's scripts/sign-file, and pack a "
        "package named after its sha256. A build the output directory already holds is served from there. "
        "A failed compile keeps the log and exits 3 with the first compiler error.",
        epilog="examples:\n"
               "  driverd build --source /usr/src/nvidia-open-kernel.tar.xz --kernel 6.1.0-47-cloud-amd64 \\\n"
               "                --flavor open --out /srv/driverd-repo\n"
               "  driverd build --source /usr/src/nvidia-kernel.tar.xz --kernel 6.1.0-47-cloud-amd64 \\\n"
               "                --flavor proprietary --sign-key mok.key --sign-cert mok.der --out out/ --json")
    p.add_argument("--source", required=True, metavar="PATH", help="NVIDIA kernel-module source: tarball or tree")
    p.add_argument("--kernel", required=True, metavar="RELEASE", help="kernel release, e.g. 6.1.0-47-cloud-amd64")
    p.add_argument("--headers", metavar="DIR", help="kernel headers (default: <root>/lib/modules/RELEASE/build, "
                   f"then {', '.join(d.headers_for('RELEASE')) if d else '...'})")
    add_flavor(p, required=True, choices=("open", "proprietary"), help="kernel-module flavour")
    p.add_argument("--sign-key", metavar="KEY", help="private key for sign-file: a path on this machine (the build "
                   "host), never under --root (default: signing.key, read the same way)")
    p.add_argument("--sign-cert", metavar="CERT", help="certificate for sign-file, a path on this machine; enrol it "
                   "on the nodes (docs/signing.md: mokutil --import) (default: signing.cert)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory (or repository) to write the package to")
    # --make-jobs, as build-matrix names make's -j (its --jobs is how many cells build at once)
    p.add_argument("--make-jobs", dest="jobs", type=int, metavar="N", help="make -jN (default: number of CPUs)")
    p.add_argument("--jobs", "-j", dest="jobs", type=int, metavar="N", action=Deprecated, new="--make-jobs",
                   why=" in build (build-matrix's --jobs counts cells)", help=argparse.SUPPRESS)
    add_work_dir(p, "where sources are unpacked and built (default: <cache_dir>/build); extracted sources are "
                 "reused")
    p.add_argument("--no-strip", action="store_true", help="keep debug info in the modules (10x larger)")
    add_ccache(p)
    add_rebuild(p)
    p.set_defaults(handler=cmd_build)

    p = sub.add_parser(
        "build-userspace", parents=[common], formatter_class=F,
        help="pack NVIDIA's user-space of one driver version (libraries, binaries, firmware) as a package",
        description="Pack the user-space half of a driver — the libraries with their versioned names and sonames "
        "(libnvidia-ml, libcuda, libnvidia-ptxjitcompiler, libnvidia-nvvm, ... and video/graphics where the source "
        "has them), nvidia-smi, nvidia-persistenced, nvidia-modprobe, the MPS tools, the GSP firmware and the "
        "EGL/Vulkan ICD files — as one kernel-independent package per (version, arch), "
        "driverd-userspace-<version>-<arch>.<sha256>.tar.zst, whose manifest lists every file with its size, mode "
        "and sha256 and every soname link. Sources: Debian's .debs of one version (--from-debs; read without "
        "dpkg), or the directory NVIDIA's installer makes with `sh NVIDIA-Linux-<arch>-<version>.run "
        "--extract-only` (--from-run-dir; driverd never runs a .run itself). The same inputs give the same "
        "package (same sha256). Fabric manager, nscq and IMEX ship separately from NVIDIA and are not part of it.",
        epilog="examples:\n"
               "  apt-get download libcuda1 libnvidia-ml1 nvidia-smi nvidia-persistenced libnvidia-ptxjitcompiler1 \\\n"
               "                   libnvidia-nvvm4 firmware-nvidia-gsp ...      # into one directory per version\n"
               "  driverd build-userspace --from-debs debs/550.163.01 --out /srv/driverd-repo\n"
               "  sh NVIDIA-Linux-x86_64-550.163.01.run --extract-only\n"
               "  driverd build-userspace --from-run-dir NVIDIA-Linux-x86_64-550.163.01 --out /srv/driverd-repo --json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-debs", metavar="DIR", help="a directory holding the .debs of one driver version")
    src.add_argument("--from-run-dir", metavar="DIR", help="the directory `sh NVIDIA-Linux-…run --extract-only` made")
    p.add_argument("--arch", metavar="ARCH", help="architecture (default: the .debs', or the .run directory's name)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory (or repository) to write the package to")
    p.set_defaults(handler=cmd_build_userspace)

    p = sub.add_parser(
        "build-companion", parents=[common], formatter_class=F,
        help="pack NVIDIA's fabric manager, nscq, NVLSM or IMEX of one driver version as a package",
        description="NVSwitch/NVLink hosts run companions that must be exactly the loaded driver's version: "
        "NVIDIA's fabric manager, libnvidia-nscq, NVLSM and nvidia-imex. Pack one of NVIDIA's per-version "
        "redistributable archives (<component>-linux-<x86_64|sbsa>-<version>-archive.tar.xz) as a package per "
        "(component, driver version, arch), driverd-companion-<component>-<version>-<arch>.<sha256>.tar.zst: its "
        "bin/, sbin/, lib/ (each library with its soname), etc/, share/ and systemd/ and NVIDIA's documents, every "
        "file with its size, mode and sha256, NVIDIA's links in the manifest. With --redistrib, the archive's size "
        "and sha256 are checked against NVIDIA's redistrib_<version>.json before it is unpacked. Refused in one "
        "line, writing nothing: an archive of another version than --driver, a link out of the tree, a setuid or "
        "setgid file, a damaged archive, a sha256 other than the JSON's, an unknown component. The same archive "
        "gives the same package (same sha256).",
        epilog="examples:\n"
               "  driverd build-companion fabricmanager-linux-x86_64-550.163.01-archive.tar.xz \\\n"
               "      --redistrib redistrib_550.163.01.json --driver 550.163.01 --out /srv/driverd-repo\n"
               "  driverd build-companion nvlsm-linux-sbsa-2025.03.9-archive.tar.xz --driver 570.133.20 --out repo/ --json\n"
               "  driverd repo index /srv/driverd-repo     # lists them under \"companions\"")
    p.add_argument("archive", metavar="ARCHIVE", help="NVIDIA's <component>-linux-<platform>-<version>-archive.tar.xz")
    p.add_argument("--redistrib", metavar="JSON", help="NVIDIA's redistrib_<driver version>.json listing the archive: "
                   "its size and sha256 are checked before anything is unpacked")
    p.add_argument("--driver", metavar="VERSION", help="the driver version it must be (NVLSM, versioned on its own: "
                   "the driver it goes with, unless --redistrib says)")
    p.add_argument("--out", required=True, metavar="DIR", help="directory (or repository) to write the package to")
    p.set_defaults(handler=cmd_build_companion)

    d = _default_distro(sub, "build-matrix")
    p = sub.add_parser(
        "build-matrix", parents=[common], formatter_class=F,
        help="build every missing (kernel x flavour x driver) cell of a matrix file",
        description="Read a declarative matrix (kernels/*.toml: kernel releases x flavours x driver versions, "
        "and how to get each kernel's headers) and build every cell the output repository lacks, in "
        "parallel up to --jobs cells. Cells already in the repository are skipped, so running it again is "
        "cheap. Each cell is reported as built / skipped / failed (with the reason); failures do not stop "
        "the others. Exit 3 when any cell failed. The repository index is rewritten at the end.\n\n"
        "--render-job prints Kubernetes objects instead of building: a ConfigMap with the matrix and the "
        "missing cells, an Indexed Job with one pod per missing cell (pod i runs build-matrix --cells ... "
        "--only-index i --no-index into the shared --repo-volume), and a suspended Job that indexes the "
        "repository; unsuspend it once the build Job is Complete or Failed.",
        epilog="examples:\n  driverd build-matrix kernels/debian-bookworm.toml --out /srv/driverd-repo --jobs 2\n"
               "  driverd build-matrix kernels/debian-bookworm.toml --out /srv/driverd-repo --render-job \\\n"
               "      --image registry.example/driverd:builder-0.1.0 --repo-volume pvc:driverd-repo > build.yaml")
    p.add_argument("matrix", metavar="FILE", help="matrix file, e.g. kernels/debian-bookworm.toml")
    p.add_argument("--out", metavar="DIR", help="repository directory (default: the matrix's `repository`)")
    p.add_argument("--jobs", type=int, default=None, metavar="N", help="cells built at once (default: matrix or 1)")
    p.add_argument("--make-jobs", type=int, default=None, metavar="N", help="make -jN inside each cell")
    add_work_dir(p, "build directory (default: <cache_dir>/build)")
    add_ccache(p)
    p.add_argument("--only", action="append", metavar="GLOB", help="only cells whose id matches (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print what would be built; build nothing")
    p.add_argument("--sign-key", metavar="KEY", help="sign every module (default: signing.key)")
    p.add_argument("--sign-cert", metavar="CERT", help="certificate for --sign-key (default: signing.cert)")
    p.add_argument("--install-headers", action="store_true", help="install missing kernel headers with the "
                   f"matrix's per-distro command (e.g. {d.headers_install.format(release='RELEASE') if d else '...'})")
    p.add_argument("--cells", metavar="FILE", help="build the cells listed in FILE (one id a line, the order "
                   "--only-index counts in); a rendered Job's ConfigMap carries it")
    p.add_argument("--only-index", type=int, metavar="N", help="build only the N-th selected cell (0-based; a "
                   "Job's $JOB_COMPLETION_INDEX)")
    p.add_argument("--no-index", action="store_true", help="leave the repository index alone (one indexer runs "
                   "after the Job's pods: driverd repo index)")
    g = p.add_argument_group("rendering a Kubernetes Indexed Job (--render-job)")
    g.add_argument("--render-job", action="store_true", help="print a ConfigMap, an Indexed Job (one pod per "
                   "cell --out lacks) and a suspended index Job instead of building")
    g.add_argument("--image", metavar="IMAGE", help="builder image: driverd, compiler, NVIDIA's sources and "
                   "the kernels' headers or a way to install them (default driverd:builder-0.1.0)")
    g.add_argument("--repo-volume", metavar="SPEC", help="the repository volume the pods share: pvc:CLAIM "
                   "(ReadWriteMany), host:/PATH or nfs:SERVER:/EXPORT (default pvc:driverd-repo)")
    g.add_argument("--ccache-volume", metavar="SPEC", help="the compiler cache volume the pods share, mounted at "
                   "/ccache: pvc:CLAIM (ReadWriteMany; deploy/build-matrix/ccache-pvc.yaml makes a 5 GiB one), "
                   "host:/PATH, nfs:SERVER:/EXPORT, or none (default pvc:driverd-ccache)")
    g.add_argument("--job-name", metavar="NAME", help="name of the Job and ConfigMap (default "
                   "driverd-build-<matrix file name>)")
    g.add_argument("--namespace", metavar="NS", help="namespace of the objects (default: kubectl's)")
    g.add_argument("--sign-secret", metavar="SECRET", help="Secret with `key` and `cert`: sign every module")
    g.add_argument("--index-sign-secret", metavar="SECRET", help="Secret with `key`: sign the repository index")
    g.add_argument("--all-cells", action="store_true", help="render every cell, not only those --out lacks")
    g.add_argument("-o", "--output", metavar="FORMAT", choices=("yaml", "json"), default=None,
                   help="yaml (default; documents separated by ---) or json (a v1 List)")
    p.set_defaults(handler=cmd_build_matrix)

    repo = sub.add_parser("repo", help="package repository tools")
    rsub = repo.add_subparsers(dest="repo_command", metavar="COMMAND")
    p = rsub.add_parser(
        "index", parents=[common], formatter_class=F, help="(re)write a repository's index.json",
        description="Scan DIR for packages (*.tar.zst), read each manifest, and atomically (re)write "
        "DIR/index.json listing driver, flavour, kernel release, arch, sha256, size and path of every package. "
        "With --sign-key the index is signed (DIR/index.json.sig, openssl dgst -sha256); fetch checks it "
        "against packages.index_public_key. The index carries a serial that only grows (max(previous + 1, unix "
        "time)) and an expiry: a node refuses an index older than one it has seen, or an expired one, so "
        "re-index (re-sign) more often than --valid-days. Nodes accept an unsigned index only from file:// "
        "(or with packages.insecure). Any static HTTP server can then serve DIR.",
        epilog="examples:\n  driverd repo index /srv/driverd-repo --sign-key /etc/driverd-repo/index-key.pem\n"
               "  python3 -m http.server -d /srv/driverd-repo")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--sign-key", metavar="KEY", help="private key (PEM) to sign index.json with (a path on this "
                   "machine, the repository's host; not under --root)")
    p.add_argument("--valid-days", type=float, default=None, metavar="DAYS", help="the index expires DAYS from now "
                   "(default 30)")
    p.add_argument("--no-verify", action="store_true", help="trust each file's name; do not re-hash packages")
    p.add_argument("--accept", metavar="INCOMING", help="first take in what a rendered build-matrix Job's pods "
                   "built: from INCOMING/<i>/ only the verified package of line i of --cells (that pod's own "
                   "cell), renamed into DIR and never over a package DIR holds; anything else is refused, left "
                   "where it is, and makes the command exit 3 (the index is still written)")
    p.add_argument("--cells", metavar="FILE", help="the cell list of the Job (its ConfigMap's `cells`), with --accept")
    p.set_defaults(handler=cmd_repo_index)

    p = sub.add_parser(
        "fetch", parents=[common], formatter_class=F,
        help="find, download and verify the package for this host's kernel",
        description="Look up the package for the host's running kernel (from facts under --root) and the "
        "requested driver and flavour in each repository in turn (https://, http://, file://), download it "
        "into the cache (<root>/var/cache/driverd; resumes partial downloads, retries with backoff, honours "
        "HTTP(S)_PROXY/NO_PROXY), check its sha256 against the index and every file against its manifest. "
        "The index must be signed (packages.index_public_key) and fresh (its serial not older than one this "
        "node has seen, not expired); unsigned is accepted only from file:// or with packages.insecure. "
        "When no repository has it, build it locally if the headers and packages.source are available "
        "(signed with signing.key/cert); otherwise exit 3 naming the package looked for and where. Key and "
        "certificate paths of the configuration are host paths, read under --root.",
        epilog="examples:\n  driverd fetch --driver 535.261.03 --flavor open --repo https://repo.example/driverd\n"
               "  driverd fetch --root /host --driver 535.261.03 --repo file:///mnt/usb/driverd --json")
    p.add_argument("--driver", metavar="VERSION", help="driver version (default: driver.version)")
    add_flavor(p, help="flavour (default: driver.flavor; auto decides from the GPUs)")
    p.add_argument("--repo", action="append", metavar="URL", help="repository URL (repeatable; default: "
                   "packages.repositories)")
    p.add_argument("--kernel", metavar="RELEASE", help="kernel release (default: the running kernel)")
    p.add_argument("--arch", metavar="ARCH", help="architecture (default: the kernel's)")
    p.add_argument("--no-build", action="store_true", help="never fall back to a local build")
    p.add_argument("--install", action="store_true", help="install the package right away (as `driverd install`); "
                   "its files are then verified once, while unpacking")
    add_wait(p)
    add_force(p)
    p.set_defaults(handler=cmd_fetch)

    p = sub.add_parser(
        "install", parents=[common], formatter_class=F,
        help="install a package's modules and firmware for its kernel (does not load them)",
        description="Check the package's vermagic against the target kernel, refuse modules the kernel would "
        "refuse when it enforces signatures (unsigned, or signed by a key not in its trusted keyrings: read from "
        "the .ko files, see docs/signing.md), verify every file, then install the modules (0644, directories "
        "0755, whatever the archive says) into "
        "<root>/lib/modules/<release>/updates/driverd/ and firmware into <root>/lib/firmware/nvidia/<version>/ "
        "through a staging directory and an atomic switch, run depmod and check that modprobe resolves "
        "nvidia. The replaced package is kept first, by sha256, in <root>/var/lib/driverd/packages/kept/ "
        "(rollback-install and any rollback bring it back). One journalled run under the host lock: a "
        "process killed at any point is finished by the next driverd command. A package for another kernel "
        "or with unsigned modules under enforcement is refused before anything starts. Installing the "
        "same package again changes nothing and writes nothing.",
        epilog="example:\n  driverd install --root /host /var/cache/driverd/driverd-535.261.03-open-....tar.zst")
    p.add_argument("package", metavar="PACKAGE")
    p.add_argument("--kernel", metavar="RELEASE", help="target kernel (default: the running kernel, else the "
                   "package's)")
    p.add_argument("--enforce-signatures", choices=("auto", "yes", "no"), default="auto",
                   help="treat the kernel as enforcing module signatures (default auto: from the host facts); "
                   "under enforcement every module's signature is read from the .ko and its signer looked up in "
                   "the kernel's keyrings and signing.trusted_certs (host paths under --root)")
    p.add_argument("--dry-run", action="store_true", help="make every check and verify every file; write nothing")
    add_wait(p)
    add_force(p)
    p.set_defaults(handler=cmd_install)

    p = sub.add_parser(
        "prepare-kernel", parents=[common], formatter_class=F,
        help="fetch (or build) and install the driver package for another kernel, before booting it",
        description="For a kernel release that is installed but not running yet (the kernel package's "
        "post-install hook calls this: systemd/kernel-postinst.d/driverd), fetch the package for the "
        "configured driver from the repositories — or build it locally when none has it — verify it and "
        "install it into <root>/lib/modules/RELEASE/updates/driverd/, so the first boot into that kernel "
        "has its driver without a compile. The running kernel and its driver are not touched. A "
        "journalled transaction under the host lock; running it again changes nothing.",
        epilog="examples:\n  driverd prepare-kernel 6.1.0-50-cloud-amd64\n"
               "  driverd prepare-kernel 6.1.0-50-cloud-amd64 --no-build   # fail fast when no repository has it")
    p.add_argument("release", metavar="RELEASE", help="the kernel release, as in /lib/modules/RELEASE")
    p.add_argument("--driver", metavar="VERSION", help="driver version (default: driver.version)")
    add_flavor(p, help="flavour (default: driver.flavor)")
    p.add_argument("--arch", metavar="ARCH", help="architecture (default: the running kernel's)")
    p.add_argument("--no-build", action="store_true", help="never fall back to a local build")
    p.add_argument("--dry-run", action="store_true", help="say what would be done; change nothing")
    add_wait(p)
    p.set_defaults(handler=cmd_prepare_kernel)

    p = sub.add_parser(
        "reboot-ready", parents=[common], formatter_class=F,
        help="exit 0 only when every newer installed kernel has this node's driver installed and verified",
        description="The reboot gate: may this node reboot without coming back with no GPU driver? Every "
        "installed kernel newer than the running one (the boot loader starts the newest: Debian/Ubuntu read "
        "from /boot and the dpkg database, RPM-based hosts from /lib/modules/RELEASE/vmlinuz and /boot) must "
        "have a driverd package of the node's driver installed and verified: its files as installed, every "
        "module's vermagic that kernel's, and — where that kernel enforces module signatures — signed by a key "
        "its keyrings (or signing.trusted_certs) trust. A kernel whose own installation is unfinished (its "
        "package half-installed, a /boot image without modules, modules without modules.dep) closes the gate "
        "too. Exit 0: the gate is open; exit 1: it is closed, each kernel named with what it lacks and the fix "
        "(kured runs the sentinel command every period: a zero exit means reboot). Read-only; it "
        "answers in a fraction of a second. The node's driver: --driver, else the driver driverd last "
        "converged it to in cluster mode, else driver.version.",
        epilog="examples:\n  driverd reboot-ready\n  driverd reboot-ready --json\n"
               "  driverd reboot-ready --if-required     # kured: --reboot-sentinel-command (docs/reboots.md)\n"
               "  driverd reboot-ready --root /host      # from the driver container")
    p.add_argument("--driver", metavar="VERSION", help="judge this driver version (default: the node's driver)")
    add_flavor(p, help="flavour (default: the node's driver's)")
    p.add_argument("--if-required", action="store_true",
                   help="exit 0 only when a reboot is also required (/var/run/reboot-required exists): what kured's "
                   "--reboot-sentinel-command needs, as its zero exit reboots the node")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing; the exit status says it")
    p.set_defaults(handler=cmd_reboot_ready)

    p = sub.add_parser(
        "rollback-install", parents=[common], formatter_class=F,
        help="put back the installation the last install replaced",
        description="Put back, from the kept store, the package the last install (or rollback-install) "
        "replaced, and run depmod: a journalled run under the host lock. The rolled-back installation becomes "
        "the previous one, so running it twice returns to the start. Loaded modules are not touched "
        "(driverd rollback also reloads).")
    p.add_argument("--kernel", metavar="RELEASE", help="kernel release (default: the running kernel)")
    p.add_argument("--dry-run", action="store_true", help="say what would be put back; change nothing")
    add_wait(p)
    add_force(p)
    p.set_defaults(handler=cmd_rollback)


def cmd_prepare_kernel(ctx, args) -> int:
    from driverd.apply import lifecycle as lc
    from driverd.cli.lifecycle_cmds import finish
    from driverd.repo.fetch import want_for_host
    cfg = ctx.config.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    want = want_for_host(ctx.root, cfg, args.release, args.arch)
    req = lc.prepare_kernel_request(cfg, want, allow_build=not args.no_build)
    out = lc.transact(ctx.step_context(cfg), req, wait_s=args.wait, dry_run=ctx.dry_run)
    return finish(ctx, out, lambda o: f"kernel {want.kernel_release}: driver {want.driver} ({want.flavor}) "
                  + ("prepared" if o["state"] == "done" else "already prepared" if o["state"] == "nothing-to-do"
                     else o["state"]))


def cmd_reboot_ready(ctx, args) -> int:
    from driverd.errors import EXIT_UNEXPECTED
    from driverd.install.rebootgate import judge
    cfg = ctx.config
    g = judge(ctx.root, cfg, version=args.driver, flavor=args.flavor)
    out = g.to_json()
    ready = g.ready
    if args.if_required:
        required = ctx.root.lexists("/var/run/reboot-required")
        out["reboot_required"] = required
        if not required:
            ready = False
            out["reason"] = "no reboot is required (/var/run/reboot-required is absent); the gate is " + \
                ("open" if g.ready else "closed: " + g.reason)
    if not args.quiet:
        emit(ctx.json, out, lambda o: (g.text() if not args.if_required or out.get("reboot_required")
                                       else "reboot-ready: no, " + out["reason"]))
    return EXIT_OK if ready else EXIT_UNEXPECTED


def _release(ctx, given: str | None) -> str:
    from driverd.host.kernel import running_release
    rel = given or running_release(ctx.root)
    if not rel:
        raise UsageError("kernel release unknown", cause="no --kernel and no /proc/sys/kernel/osrelease under "
                         "the root", fix="pass --kernel RELEASE")
    return rel


def cmd_install(ctx, args) -> int:
    """One journalled step under the host lock; a failure restores the package that was installed.
    --dry-run makes every check a real install makes (vermagic, signatures, every file's hash)."""
    from driverd.apply import lifecycle as lc
    from driverd.cli.lifecycle_cmds import cluster_guard, finish, forced
    if not os.path.isfile(args.package):
        raise UsageError(f"package {args.package} does not exist", fix="pass the path `driverd fetch` printed")
    enforce = {"auto": None, "yes": True, "no": False}[args.enforce_signatures]
    package = os.path.abspath(args.package)
    if ctx.dry_run:
        from driverd.install.modules import install
        rep = install(ctx.root, package, ctx.runner, kernel=args.kernel, enforce=enforce,
                      state_dir=ctx.config["state.dir"]).to_json()
        emit(ctx.json, rep, lambda r: f"dry run: would install {r['driver_version']} ({r['flavor']}) for "
             f"{r['kernel_release']} into {r['modules_dir']} (package verified; nothing written)" if r["changed"]
             else f"dry run: {r['driver_version']} ({r['flavor']}) is already installed; nothing to do")
        return EXIT_OK
    reason = cluster_guard(ctx, args, "install")
    req = lc.install_request("install", package, args.kernel, enforce)
    out = lc.transact(ctx.step_context(), req, wait_s=args.wait)
    out["report"] = next((r["result"] for r in out["results"] if r["action"] == "install-package"), None)
    return finish(ctx, forced(ctx, "install", reason, out), _install_head)


def _install_head(o: dict) -> str:
    r = o.get("report")
    if not r or o["state"] != "done":
        return ""
    return (f"installed {r['driver_version']} ({r['flavor']}) for {r['kernel_release']} into {r['modules_dir']}"
            + (f"\n  modprobe resolves nvidia: {' '.join(os.path.basename(x) for x in r['resolves'])}"
               if r.get("resolves") else ""))


def cmd_rollback(ctx, args) -> int:
    from driverd.apply import lifecycle as lc
    from driverd.cli.lifecycle_cmds import cluster_guard, finish, forced
    reason = cluster_guard(ctx, args, "rollback-install")
    req = lc.rollback_install_request(_release(ctx, args.kernel))
    out = lc.transact(ctx.step_context(), req, wait_s=args.wait, dry_run=ctx.dry_run)
    return finish(ctx, forced(ctx, "rollback-install", reason, out))


def cmd_build(ctx, args) -> int:
    from driverd.cli.interrupt import terminate_as_interrupt
    from driverd.build.modules import build
    from driverd.build.progress import Reporter, clock
    cfg = ctx.config
    from driverd.build.sign import signing_pair
    key, cert = signing_pair(cfg, args.sign_key, args.sign_cert)
    work = args.work_dir or str(ctx.root.real(f"{cfg['packages.cache_dir']}/build"))
    from driverd.build.compiler_cache import from_config
    cache = from_config(ctx.root, cfg, work, args.ccache, args.ccache_dir)
    progress = Reporter()           # stderr: a script reading --json's stdout still sees progress in its log
    try:
        with terminate_as_interrupt():
            res = build(source=args.source, kernel=args.kernel, flavor=args.flavor, out=args.out,
                        headers=args.headers, sign_key=key, sign_cert=cert, jobs=args.jobs, work_dir=work,
                        strip=not args.no_strip, force=args.rebuild, root=ctx.root, runner=ctx.runner,
                        progress=progress, ccache=cache)
    finally:
        progress.close()
    from driverd.cli.output import log
    log(f"{'served from ' + args.out if res.cached else 'built'} in {clock(res.seconds)}")
    emit(ctx.json, res.to_json(), lambda r: r["package"])
    return EXIT_OK


def cmd_build_userspace(ctx, args) -> int:
    from driverd.build import userspace as ub
    src = args.from_debs or args.from_run_dir
    if not os.path.isdir(src):
        raise UsageError(f"{src} is not a directory", fix="pass the directory holding the .debs (--from-debs) or "
                         "the one `sh NVIDIA-Linux-…run --extract-only` made (--from-run-dir)")
    fn = ub.build_from_debs if args.from_debs else ub.build_from_run_dir
    res = fn(src, args.out, arch=args.arch)
    emit(ctx.json, res.to_json(), lambda r: f"{r['package']}\n  {r['driver']} {r['arch']} from {r['source']}: "
         f"{len(r['libraries'])} libraries ({', '.join(f'{k} {v}' for k, v in r['components'].items())}), "
         f"{len(r['binaries'])} binaries, {len(r['firmware'])} firmware files, {len(r['icd'])} ICD files"
         + "".join(f"\n  note: {n}" for n in r["notes"]))
    return EXIT_OK


def cmd_build_companion(ctx, args) -> int:
    from driverd.build.companion import build_from_archive
    for what, path in (("ARCHIVE", args.archive), ("--redistrib", args.redistrib)):
        if path is not None and not os.path.isfile(path):
            raise UsageError(f"{what} {path} is not a file", fix="pass NVIDIA's archive (and its redistrib JSON) as "
                             "downloaded")
    res = build_from_archive(args.archive, args.out, redistrib=args.redistrib, driver=args.driver)
    emit(ctx.json, res.to_json(), lambda r: f"{r['package']}\n  {r['component']} {r['component_version']} for driver "
         f"{r['driver']} {r['arch']}: {r['files']} files, {len(r['binaries'])} binaries, {len(r['libraries'])} "
         f"libraries, {len(r['configs'])} config files, {len(r['links'])} links"
         + (f"; checked against {r['checked_against']}" if r["checked_against"] else "")
         + "".join(f"\n  note: {n}" for n in r["notes"]))
    return EXIT_OK


def _cell_list(path: str | None) -> list[str] | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    except OSError as e:
        raise UsageError(f"cannot read --cells {path}: {e.strerror}", fix="pass the cell list file") from None


def cmd_render_job(ctx, args, m, out: str | None) -> int:
    import json
    import sys
    from driverd.build import matrix as mx
    from driverd.build import job as mj
    cells = mx.select(m, args.only, _cell_list(args.cells))
    todo = cells if args.all_cells or not out else mx.missing(m, out, cells)
    opts = mj.JobOptions(image=args.image or mj.DEFAULT_IMAGE, repo_volume=args.repo_volume or mj.DEFAULT_REPO_VOLUME,
                         ccache_volume=args.ccache_volume or mj.DEFAULT_CCACHE_VOLUME,
                         ccache_max_mb=ctx.config["build.ccache_max_mb"],
                         name=args.job_name, namespace=args.namespace, parallelism=args.jobs,
                         make_jobs=args.make_jobs if args.make_jobs is not None else (m.make_jobs or None),
                         sign_secret=args.sign_secret, index_sign_secret=args.index_sign_secret)
    objs = mj.render(m, todo, opts)
    from driverd.log import log
    log(f"build-matrix: rendered job {objs[1]['metadata']['name']}: {len(todo)} of {len(cells)} cell(s) to build"
        + ("" if args.all_cells or not out else f" ({len(cells) - len(todo)} already in {out})"),
        cells=len(todo))
    if args.output == "json" or (args.output is None and ctx.json):
        json.dump(mj.to_json(objs), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(mj.to_yaml(objs))
    return EXIT_OK


def cmd_build_matrix(ctx, args) -> int:
    from driverd.errors import EXIT_BLOCKED
    from driverd.build import matrix as mx
    m = mx.load(args.matrix)
    out = args.out or m.repository
    if args.render_job:
        return cmd_render_job(ctx, args, m, out)
    if not out:
        raise UsageError("no output repository", fix="pass --out DIR or set `repository` in the matrix")
    work = args.work_dir or str(ctx.root.real(f"{ctx.config['packages.cache_dir']}/build"))
    from driverd.build.sign import signing_pair
    key, cert = signing_pair(ctx.config, args.sign_key, args.sign_cert)
    from driverd.cli.interrupt import terminate_as_interrupt
    from driverd.build.compiler_cache import from_config
    cache = None if args.dry_run else from_config(ctx.root, ctx.config, work, args.ccache, args.ccache_dir)
    with terminate_as_interrupt():
        results = mx.run(m, out, jobs=args.jobs, make_jobs=args.make_jobs, work_dir=work, only=args.only,
                         dry_run=args.dry_run, install_headers=args.install_headers,
                         sign_key=key, sign_cert=cert, ccache=cache,
                         root=ctx.root, runner=ctx.runner,
                         progress=None, cell_ids=_cell_list(args.cells), only_index=args.only_index,
                         index=not args.no_index)
    counts = {s: sum(1 for r in results if r.status == s) for s in ("built", "skipped", "failed", "would-build")}
    data = {"matrix": str(m.path), "repository": out, **counts, "ccache": cache.to_json() if cache else None,
            "cells": [r.to_json() for r in results]}
    emit(ctx.json, data, lambda d: f"{d['built']} built, {d['skipped']} skipped, {d['failed']} failed"
         + (f", {d['would-build']} would be built" if d["would-build"] else "") + f" (repository {d['repository']})")
    return EXIT_BLOCKED if counts["failed"] else EXIT_OK


def cmd_repo_index(ctx, args) -> int:
    from driverd.errors import EXIT_BLOCKED
    from driverd.fsutil import trusted_dir
    from driverd.repo.index import INDEX_NAME, write_index
    from driverd.repo.trust import DEFAULT_VALID_DAYS
    if bool(args.accept) != bool(args.cells):
        raise UsageError("--accept and --cells go together",
                         fix="pass both (a rendered Job's index pod does), or neither")
    # what is signed is what this directory holds: nobody but root (or you) may be able to change it
    trusted_dir(args.dir, "repository directory")
    intake = []
    if args.accept:
        from driverd.build.intake import accept
        trusted_dir(args.accept, "--accept directory", missing_ok=True)
        cells = _cell_list(args.cells) or []
        intake = accept(args.dir, args.accept, cells) if os.path.isdir(args.accept) else \
            [_missing(i, c, args.accept) for i, c in enumerate(cells)]
    idx = write_index(args.dir, sign_key=args.sign_key, runner=ctx.runner, verify=not args.no_verify,
                      valid_days=args.valid_days if args.valid_days is not None else DEFAULT_VALID_DAYS)
    out = {"index": os.path.join(args.dir, INDEX_NAME), "packages": len(idx.packages),
           "userspace_packages": len(idx.userspace), "companion_packages": len(idx.companions),
           "signed": bool(args.sign_key),
           "serial": idx.serial, "expires": idx.expires, "entries": idx.to_json()["packages"]}
    if args.accept:
        out["intake"] = [r.to_json() for r in intake]
    refused = [r for r in intake if r.status == "refused"]

    def text(r: dict) -> str:
        lines = [f"{x['status']:<8} [{x['index']}] {x['cell']}" + (f": {x['reason']}" if x["reason"] else "")
                 for x in r.get("intake", [])]
        return "\n".join(lines + [
            f"wrote {r['index']}: {r['packages']} packages"
            + (f", {r['userspace_packages']} user-space packages" if r["userspace_packages"] else "")
            + (f", {r['companion_packages']} companion packages" if r["companion_packages"] else "")
            + f", serial {r['serial']}, expires "
            f"{r['expires']}" + (" (signed)" if r["signed"] else " (UNSIGNED: nodes accept it only from file:// or "
                                                                  "with packages.insecure)")])
    emit(ctx.json, out, text)
    return EXIT_BLOCKED if refused else EXIT_OK


def _missing(i: int, cell: str, incoming: str):
    from driverd.build.intake import Intake
    return Intake(i, cell, "missing", f"{incoming} does not exist (no pod built anything)")


def repo_arg(url: str) -> str:
    """--repo URL, checked as packages.repositories is (one rule: driverd.config's); a relative directory
    is made absolute, the way a shell user means it."""
    from driverd.config import REPO_URL_HINT, REPO_URL_RE
    if "://" not in url:
        url = os.path.abspath(url)
    if not REPO_URL_RE.match(url):
        scheme = url.split("://", 1)[0]
        raise UsageError(f"--repo {url}: driverd cannot fetch over {scheme}://",
                         cause="repositories are read over https://, http:// or file://",
                         fix=f"pass {REPO_URL_HINT}")
    return url


def cmd_fetch(ctx, args) -> int:
    from driverd.build.obtain import fetch_configured
    from driverd.repo.fetch import want_for_host
    cfg = ctx.config.with_overrides({"driver.version": args.driver, "driver.flavor": args.flavor})
    repos = [repo_arg(u) for u in args.repo] if args.repo else cfg["packages.repositories"]
    reason = None
    if args.install:
        from driverd.cli.lifecycle_cmds import cluster_guard
        reason = cluster_guard(ctx, args, "fetch --install")
    want = want_for_host(ctx.root, cfg, args.kernel, args.arch)
    res = fetch_configured(ctx.root, cfg, want, repos, runner=ctx.runner, allow_build=not args.no_build,
                           verify_files=not args.install)
    out = res.to_json()
    if args.install:
        from driverd.apply import lifecycle as lc
        req = lc.install_request("fetch --install", str(res.package), want.kernel_release, None, res.sha256)
        from driverd.cli.lifecycle_cmds import forced
        tx = forced(ctx, "fetch --install", reason, lc.transact(ctx.step_context(cfg), req, wait_s=args.wait))
        out["install"] = tx
        lc.raise_for(tx)
    emit(ctx.json, out, lambda r: r["package"] + (
        f"\ninstalled ({r['install']['run_id']})" if r.get("install") and r["install"]["state"] == "done"
        else "\nalready installed" if r.get("install") else ""))
    return EXIT_OK
