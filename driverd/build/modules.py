"""`driverd build`: compile NVIDIA's kernel modules for one kernel with kbuild and pack a package.

kbuild facts this relies on (NVIDIA's top-level Makefile):
- SYSSRC names the kernel *source* tree and SYSOUT the kernel *output* (build) tree; without SYSSRC
  the Makefile derives both from /lib/modules/$(KERNEL_UNAME)/{source,build}. Debian splits headers
  into linux-headers-<rel> (the output tree: .config, Module.symvers, generated headers; its Makefile
  only includes the common one) and linux-headers-<flavour-less>-common (the source tree). Passing only
  SYSSRC=<the arch tree> makes the source and output the same tree, so the compiler looks for
  include/ in the wrong place (the `stdarg.h: No such file` failure). We pass both SYSSRC=<common> and
  SYSOUT=<arch>, found from the headers directory, so nothing under this machine's /lib/modules is
  needed or touched, and --headers may point anywhere.
- The modules are written into the source tree, so every build works on its own copy of the sources
  (extracted once per source tarball and reused).
- Modules are stripped of debug info (`strip --strip-debug`, what INSTALL_MOD_STRIP=1 does) before
  they are signed: signing must come last, it appends the signature to the file.
- The sources are copied to src/ of a cell directory. With a compiler cache
  (driverd.build.compiler_cache) a view of the kernel's header trees sits beside them (kernel/),
  and make gets SYSSRC/SYSOUT of the view, so every compile sees the same paths in every cell.
  Cached or not, every module is checked against the tree it was built from before it is packed
  (check_modules: vermagic, version, srcversion).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from driverd import safetar
from driverd.datatypes import dataclass
from driverd.errors import PackageError, UsageError
from driverd.fsutil import atomic_write_json, writable_dir
from driverd.package.archive import SUFFIX, PackageRef, read_manifest, sha256_file
from driverd.build import host as buildhost
from driverd.build import progress as buildprogress
from driverd.build import compiler_cache
from driverd.build.assemble import PackageSpec, assemble
from driverd.build.compiler_cache import CompilerCache
from driverd.package.modfields import first, module_fields
from driverd.package.manifest import Provenance, package_basename
from driverd.root import Root
from driverd.runner import Runner, which

MODULE_NAMES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")
_ERROR_RE = re.compile(r"(?:^|\s)(?:error|fatal error):\s", re.I)
_VERSION_RE = re.compile(r'NV_VERSION_STRING=\\?"([0-9.]+)\\?"')
_SRCVERSION_RE = re.compile(r'^MODULE_INFO\(srcversion, "([0-9A-F]+)"\);', re.M)
BUILD_EXIT = 3


@dataclass
class BuildResult:
    """The package one `driverd build` made, or found already in the output directory, and how long it took."""
    package: PackageRef
    cached: bool
    seconds: float
    log: str | None = None
    phases: dict[str, float] | None = None      # seconds per step: extract, copy, headers, make, strip, sign, pack
    ccache: dict | None = None                  # the compiler cache used: dir, hits, misses, uncacheable

    def to_json(self) -> dict:
        return {**self.package.to_json(), "cached": self.cached, "seconds": round(self.seconds, 2), "log": self.log,
                "phases": {k: round(v, 2) for k, v in (self.phases or {}).items()}, "ccache": self.ccache}


class BuildFailed(PackageError):
    """The compiler failed: message is the first compiler error, details carry the log path."""


class WrongModule(PackageError):
    """A built module is not what this source and these headers make (check_modules)."""


# -- sources ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """An extracted NVIDIA kernel-module source tree to build from, with its driver version and origin."""
    tree: Path            # the directory holding the top-level Makefile and Kbuild
    version: str
    sha256: str | None
    origin: str


def _find_tree(d: Path) -> Path | None:
    if (d / "Kbuild").is_file() and (d / "Makefile").is_file():
        return d
    for kb in sorted(d.glob("*/Kbuild")) + sorted(d.glob("*/*/Kbuild")) + sorted(d.glob("*/*/*/Kbuild")):
        if (kb.parent / "Makefile").is_file() and (kb.parent / "nvidia").is_dir():
            return kb.parent
    return None


def source_version(tree: Path) -> str:
    try:
        m = _VERSION_RE.search((tree / "Kbuild").read_text(errors="replace"))
    except OSError:
        m = None
    if not m:
        raise PackageError(f"cannot tell the driver version of {tree}", cause="Kbuild has no NV_VERSION_STRING",
                           fix="pass an NVIDIA kernel-module source tree or tarball")
    return m.group(1)


def prepare_source(source: str | os.PathLike, work: Path) -> Source:
    """An extracted source tree for `source` (tarball: extracted once into work/sources/<sha256>)."""
    src = Path(source)
    if src.is_dir():
        tree = _find_tree(src)
        if tree is None:
            raise PackageError(f"{src} is not an NVIDIA kernel-module source tree",
                               cause="no Kbuild + Makefile + nvidia/ found", fix="pass the tree or the tarball")
        return Source(tree, source_version(tree), None, str(src))
    if not src.is_file():
        raise UsageError(f"source {src} does not exist",
                         fix="install nvidia-open-kernel-source (or nvidia-kernel-source) or pass --source PATH")
    sha = _cached_sha(src, work)
    dest = work / "sources" / sha[:32]
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract.", dir=_mk(work / "sources")))
        try:
            # driverd.safetar, not tarfile's extraction filters (absent before Python 3.11.4).
            safetar.extract_file(src, tmp, links="inside")
            (tmp / ".complete").write_text(str(src) + "\n")
            os.rename(tmp, dest)
        except (safetar.UnsafeMember, tarfile.TarError, OSError, EOFError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PackageError(f"cannot extract {src}: {e}", fix="check the source tarball") from None
    tree = _find_tree(dest)
    if tree is None:
        raise PackageError(f"{src} holds no NVIDIA kernel-module source", fix="pass the right tarball")
    return Source(tree, source_version(tree), sha, str(src))


def _mk(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cached_sha(src: Path, work: Path) -> str:
    """sha256 of a tarball, remembered by (path, size, mtime) so a repeated build need not re-hash it."""
    st = src.stat()
    memo = work / "sources" / "sha256.json"
    key = f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = sha256_file(src)
        _mk(memo.parent)
        atomic_write_json(memo, known)
    return known[key]


def peek_version(source: str | os.PathLike, work: Path) -> str | None:
    """The driver version of `source` without extracting it when it was extracted before."""
    src = Path(source)
    if src.is_dir():
        t = _find_tree(src)
        return source_version(t) if t else None
    if not src.is_file():
        return None
    d = work / "sources" / _cached_sha(src, work)[:32]
    if (d / ".complete").exists():
        t = _find_tree(d)
        return source_version(t) if t else None
    return None


# -- headers ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Headers:
    """One kernel's headers as kbuild takes them: the output (build) tree and the source tree."""
    output: Path          # SYSOUT: .config, Module.symvers, generated headers
    source: Path          # SYSSRC

    @property
    def config(self) -> dict[str, str]:
        out = {}
        try:
            for ln in (self.output / ".config").read_text().splitlines():
                if ln.startswith("CONFIG_") and "=" in ln:
                    k, _, v = ln.partition("=")
                    out[k] = v.strip('"')
        except OSError:
            pass
        return out


def find_headers(root: Root, release: str, given: str | None = None) -> Headers:
    fam = buildhost.family(root)
    cands = [Path(given)] if given else [root.real(f"/lib/modules/{release}/build"),
                                         *(root.real(d) for d in fam.headers_for(release))]
    for c in cands:
        if (c / "Makefile").is_file() and (c / ".config").is_file():
            return Headers(c, _source_of(c))
    raise PackageError(f"kernel headers for {release} not found (looked in {', '.join(map(str, cands))})",
                       cause="the headers package is not installed",
                       fix=f"install {fam.headers_package.format(release=release)} or pass --headers DIR")


def _source_of(out: Path) -> Path:
    if (out / "source").is_dir():
        return (out / "source").resolve()
    try:
        m = re.search(r"^include\s+(\S+)/Makefile\s*$", (out / "Makefile").read_text(), re.M)
    except OSError:
        m = None
    if m and Path(m.group(1)).is_dir():
        return Path(m.group(1))
    return out


def kernel_release_of(headers: Headers) -> str | None:
    try:
        return (headers.output / "include/config/kernel.release").read_text().strip() or None
    except OSError:
        return None


# -- build --------------------------------------------------------------------------------------

def first_compiler_error(log: str, tree: Path | None = None) -> str:
    lines = log.splitlines()
    for ln in lines:
        if _ERROR_RE.search(ln) and "warning:" not in ln.split("error", 1)[0]:
            s = ln.strip()
            if tree is not None:
                s = s.replace(str(tree) + "/", "")
            return s
    for ln in lines:
        if ln.startswith("make") and "Error" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "no output"


def existing(out: Path, version: str, flavor: str, release: str, arch: str) -> Path | None:
    base = package_basename(version, flavor, release, arch)
    for p in sorted(out.glob(f"{base}.*{SUFFIX}")):
        if re.fullmatch(re.escape(base) + r"\.[0-9a-f]{64}" + re.escape(SUFFIX), p.name):
            return p
    return None


def _arch(headers: Headers) -> str:
    cfg = headers.config
    if cfg.get("CONFIG_X86_64") == "y":
        return "x86_64"
    if cfg.get("CONFIG_ARM64") == "y":
        return "aarch64"
    return os.uname().machine


def build(**kw) -> BuildResult:
    """One package built (arguments: _build's), reported to driverd.observe as `package.build`: how
    long it took, whether it was built or served from the output directory, and why it failed."""
    from driverd import observe
    t0 = time.monotonic()
    cell = f"{kw.get('flavor')}-{kw.get('kernel')}"
    try:
        res = _build(**kw)
    except BaseException as e:
        observe.emit("package.build", result="failed", reason=_failure_reason(e), seconds=time.monotonic() - t0,
                     cell=cell)
        raise
    observe.emit("package.build", result="cached" if res.cached else "built", reason=None,
                 seconds=time.monotonic() - t0, cell=cell)
    return res


def _failure_reason(e: BaseException) -> str:
    """A short, bounded label for a failed build (metrics: failures by reason)."""
    if isinstance(e, BuildFailed):
        return "compile"
    if isinstance(e, WrongModule):
        return "check"
    if isinstance(e, UsageError):
        return "source" if "source" in e.message else "usage"
    if isinstance(e, PackageError):
        m = e.message
        for words, reason in (("kernel headers", "headers"), ("make is not installed", "toolchain"),
                              ("sign", "sign"), ("source", "source"), ("extract", "source"),
                              ("modinfo", "pack"), ("vermagic", "pack"), ("modules", "pack")):
            if words in m:
                return reason
        return "other"
    return "io" if isinstance(e, OSError) else "unexpected"


def check_out(out: str | os.PathLike) -> None:
    """The output directory can take a package: checked before minutes of compiling, not after. And only
    root (or the user building) can change it or a directory above it: a package someone else could
    replace there before it is indexed and signed is not the one built (driverd.fsutil.trusted_dir)."""
    from driverd.fsutil import Untrusted, trusted_dir, walk_trusted
    try:
        walk_trusted(out)           # the directories on the way, judged before anything is made there
    except Untrusted:
        trusted_dir(out, "output directory", missing_ok=True)      # the one-line refusal
    except OSError:
        pass                        # a path that cannot be a directory: writable_dir says why
    why = writable_dir(out)
    if why is not None:
        raise UsageError(f"output directory {out}: {why}", cause="the package is written there",
                         fix="pass --out a directory you can write to")
    trusted_dir(out, "output directory")


def _build(*, source: str | os.PathLike, kernel: str, flavor: str, out: str | os.PathLike,
          headers: str | None = None, sign_key: str | None = None, sign_cert: str | None = None,
          jobs: int | None = None, work_dir: str | os.PathLike = "/var/cache/driverd/build", strip: bool = True,
          force: bool = False, root: Root | None = None, runner: Runner | None = None,
          progress: buildprogress.Sink | None = None, ccache: CompilerCache | None = None) -> BuildResult:
    t0 = time.monotonic()
    root, runner = root or Root("/"), runner or Runner()
    prog = progress or buildprogress.Sink()
    label = [f"{flavor}-{kernel}"]           # the cell's id once the source's version is known

    def phase(name: str, done: int | None = None, total: int | None = None) -> None:
        prog.status(buildprogress.Status(label[0], name, time.monotonic() - t0, done, total))
    if flavor not in ("open", "proprietary"):
        raise UsageError(f"invalid flavor {flavor!r}", fix="pass --flavor open or --flavor proprietary")
    if bool(sign_key) != bool(sign_cert):
        raise UsageError("--sign-key and --sign-cert go together", fix="pass both or neither")
    for p in (sign_key, sign_cert):
        if p and not os.path.isfile(p):
            raise UsageError(f"signing file {p} does not exist", fix="pass an existing key and certificate")
    out, work = Path(out), _mk(Path(work_dir))
    hdr = find_headers(root, kernel, headers)
    arch = _arch(hdr)
    # Served from the output directory when it already holds this cell (the cheap path: no extraction).
    version = peek_version(source, work)
    if version and not force:
        hit = existing(out, version, flavor, kernel, arch)
        if hit is not None:
            m = read_manifest(hit)
            sha = re.search(r"\.([0-9a-f]{64})\.tar\.zst$", hit.name).group(1)
            return BuildResult(PackageRef(hit, sha, hit.stat().st_size, m), True, time.monotonic() - t0)
    check_out(out)      # served from a read-only --out above; a compile needs to write there
    phases: dict[str, float] = {}
    tp = time.monotonic()
    if Path(source).is_file():
        phase("extract")
    src = prepare_source(source, work)
    phases["extract"] = time.monotonic() - tp
    _check_flavor(src, flavor)
    if not force:
        hit = existing(out, src.version, flavor, kernel, arch)
        if hit is not None:
            m = read_manifest(hit)
            return BuildResult(PackageRef(hit, sha256_file(hit), hit.stat().st_size, m), True, time.monotonic() - t0)
    cell = f"{src.version}-{flavor}-{kernel}-{arch}"
    label[0] = cell
    logs = _mk(work / "logs")
    log_path = logs / f"{cell}.log"
    cell_dir = Path(tempfile.mkdtemp(prefix=f"{cell}.", dir=_mk(work / "cells")))
    tree = cell_dir / "src"
    try:
        phase("copy")
        tp = time.monotonic()
        shutil.copytree(src.tree, tree, symlinks=True)
        phases["copy"] = time.monotonic() - tp
        make = which("make")
        if make is None:
            raise PackageError("make is not installed", fix=f"install {buildhost.family(root).build_tools_package}")
        jobs = jobs or os.cpu_count() or 1
        sys_src, sys_out, env, extra = hdr.source, hdr.output, {"LC_ALL": "C"}, []
        if ccache is not None:
            tp = time.monotonic()
            sys_out, sys_src = compiler_cache.kernel_view(hdr.output, hdr.source, cell_dir)
            phases["headers"] = time.monotonic() - tp
            env.update(compiler_cache.env(ccache, cell_dir,
                                          compiler_cache.tree_identity(hdr.source, hdr.output, tree)))
            extra = compiler_cache.make_variables(compiler_cache.front(ccache, cell_dir), sys_out)
        argv = [make, f"-j{jobs}", "modules", f"SYSSRC={sys_src}", f"SYSOUT={sys_out}", f"KERNEL_UNAME={kernel}",
                *extra]
        prog.message(f"{cell}: make {' '.join(argv[1:])}"
                     + (f" (compiler cache {ccache.directory})" if ccache else ""))
        kb = buildprogress.Kbuild(buildprogress.expected(tree))
        phase("make")

        def line(ln: str) -> None:
            if kb.feed(ln):
                phase(kb.phase, *kb.counts())
        tp = time.monotonic()
        # its own process group: an interrupted build stops make and every compiler it started
        res = runner.run(argv, cwd=tree, timeout=3600, check=False, env=env, on_line=line, group=True)
        phases["make"] = time.monotonic() - tp
        stats = None
        if ccache is not None:
            stats = {"dir": str(ccache.directory), **(compiler_cache.build_stats(cell_dir) or {})}
            prog.message(f"{cell}: compiler cache: {stats.get('hits', 0)} hits, {stats.get('misses', 0)} misses, "
                         f"{stats.get('uncacheable', 0)} not cacheable ({buildprogress.clock(time.monotonic() - t0)})")
        log_path.write_text(f"$ {' '.join(argv)}\n{res.stdout}\n{res.stderr}")
        if not res.ok:
            err = first_compiler_error(res.stdout + "\n" + res.stderr, tree)
            raise BuildFailed(f"build of {cell} failed: {err}", cause=f"make exited {res.returncode}; log {log_path}",
                              fix="use a driver version that supports this kernel, or patch the source",
                              details={"log": str(log_path), "first_error": err})
        mods = [tree / f"{n}.ko" for n in MODULE_NAMES if (tree / f"{n}.ko").is_file()]
        if not mods:
            raise BuildFailed(f"build of {cell} produced no modules", cause=f"log {log_path}", fix="see the log")
        check_modules(tree, mods, kernel, src.version, ccache)
        tp = time.monotonic()
        if strip:
            for i, m in enumerate(mods):
                phase("strip", i, len(mods))
                runner.run(["strip", "--strip-debug", str(m)], timeout=300)
        phases["strip"] = time.monotonic() - tp
        tp = time.monotonic()
        if sign_key:
            sf = _sign_file(hdr, root)
            algo = hdr.config.get("CONFIG_MODULE_SIG_HASH", "sha256")
            for i, m in enumerate(mods):
                phase("sign", i, len(mods))
                runner.run([sf, algo, sign_key, sign_cert, str(m)], timeout=300)
        phases["sign"] = time.monotonic() - tp
        tp = time.monotonic()
        phase("pack")
        firmware = _firmware(src, flavor)
        prov = Provenance(source_sha256=src.sha256, source=src.origin, compiler=_compiler(hdr),
                          built_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          builder=f"driverd build (make -j{jobs}, SYSSRC={hdr.source}, SYSOUT={hdr.output}"
                                  + (", ccache" if ccache else "") + ")")
        ref = assemble(PackageSpec(src.version, flavor, kernel, arch, prov), mods, firmware, out)
        if force:   # one package per cell in a directory: drop the one this rebuild replaces
            for old in out.glob(f"{package_basename(src.version, flavor, kernel, arch)}.*{SUFFIX}"):
                if old != ref.path:
                    old.unlink()
        phases["pack"] = time.monotonic() - tp
        return BuildResult(ref, False, time.monotonic() - t0, str(log_path), phases, stats)
    finally:
        shutil.rmtree(cell_dir, ignore_errors=True)


def check_modules(tree: Path, mods: list[Path], kernel: str, version: str,
                  ccache: CompilerCache | None = None) -> None:
    """Every built module is what this tree and these headers make, read from the .ko itself: its
    vermagic names `kernel`, its version (when it declares one) is the source's driver version, and its
    srcversion is the one modpost computed from this tree's sources in this build (written into
    <module>.mod.c beside it). Run after every build, cached or not: an object a compiler cache should
    not have served, or a module left behind by another build, stops the build here."""
    fix = (f"clear the compiler cache (ccache -C -d {ccache.directory}) and build again, or build with --ccache off"
           if ccache else "build again with --rebuild")
    for m in mods:
        fields = module_fields(m)
        vermagic, mod_version, srcversion = first(fields, "vermagic"), first(fields, "version"), first(fields, "srcversion")
        built_for = (vermagic or "").split(" ", 1)[0]
        if built_for != kernel:
            raise WrongModule(f"{m.name} was built for kernel {built_for or '(no vermagic)'}, not {kernel}",
                              cause=f"its vermagic is {vermagic!r}", fix=fix)
        if mod_version is not None and mod_version != version:
            raise WrongModule(f"{m.name} is driver {mod_version}, not {version} (the source built)",
                              cause="its version field names another driver source", fix=fix)
        try:
            modc = (m.with_suffix(".mod.c")).read_text(errors="replace")
        except OSError:
            continue                     # kbuild without a .mod.c: nothing to compare with
        want = _SRCVERSION_RE.search(modc)
        if want and srcversion != want.group(1):
            raise WrongModule(f"{m.name} has srcversion {srcversion}, but this tree's sources give {want.group(1)}",
                              cause="the module was not linked from this build's objects", fix=fix)


def source_flavor(src: Source) -> str | None:
    """Which flavour a source tree builds, from its directory name (Debian: modules/nvidia-open-kernel
    vs modules/nvidia-kernel; NVIDIA's .run: kernel-open vs kernel)."""
    name = src.tree.name
    if name in ("nvidia-open-kernel", "kernel-open") or "open" in name:
        return "open"
    if name in ("nvidia-kernel", "kernel"):
        return "proprietary"
    return None


def _check_flavor(src: Source, flavor: str) -> None:
    have = source_flavor(src)
    if have is not None and have != flavor:
        raise UsageError(f"{src.origin} is the {have} flavour's source, not {flavor}", fix=f"pass --flavor {have}")


def _firmware(src: Source, flavor: str) -> list[Path]:
    if flavor != "open":
        return []
    found: list[Path] = []
    for base in (src.tree, src.tree.parent, src.tree.parent.parent):
        for pat in ("firmware/gsp_*.bin", f"lib/firmware/nvidia/{src.version}/gsp_*.bin"):
            found += sorted(base.glob(pat))
        if found:
            break
    return found


def _sign_file(hdr: Headers, root: Root) -> str:
    from driverd.build.sign import find_sign_file
    sf = find_sign_file(str(hdr.output), root)
    if sf is None:
        raise PackageError("scripts/sign-file not found", cause=f"neither {hdr.output}/scripts/sign-file nor an "
                           "installed linux-kbuild has it", fix="install the kernel's kbuild package")
    return sf


def _compiler(hdr: Headers) -> str | None:
    return hdr.config.get("CONFIG_CC_VERSION_TEXT")


# -- fetch's fallback ---------------------------------------------------------------------------

def cannot_build(root: Root, cfg, release: str) -> str | None:
    """Why this host cannot build a package for `release` itself, from what is cheap to see (the
    source is set and exists, the kernel's headers are installed); None: it may. The source's driver
    version is judged by local_builder, when a build is about to happen."""
    source = cfg["packages.source"]
    if not source:
        return "packages.source is not set (no driver source to build from)"
    if not os.path.exists(str(root.real(source)) if not root.is_slash else source):
        return f"driver source {source} does not exist"
    try:
        find_headers(root, release)
    except PackageError as e:
        return e.message
    return None


def local_builder(root: Root, cfg, want, runner: Runner):
    """(builder, None) when this host can build `want` itself, else (None, the reason it cannot)."""
    why = cannot_build(root, cfg, want.kernel_release)
    if why:
        return None, why
    source = cfg["packages.source"]
    src_path = str(root.real(source)) if not root.is_slash else source
    work = root.real(f"{cfg['packages.cache_dir']}/build")       # resolved inside the root, link by link
    v = peek_version(src_path, work)
    from driverd.root.nodefiles import node_path
    key, cert = (node_path(root, cfg["signing.key"], "signing.key"),     # the node's own keys
                 node_path(root, cfg["signing.cert"], "signing.cert"))

    def builder(cache: Path) -> Path:
        res = build(source=src_path, kernel=want.kernel_release, flavor=want.flavor, out=cache, work_dir=work,
                    sign_key=key, sign_cert=cert, root=root, runner=runner,
                    ccache=compiler_cache.from_config(root, cfg, work))
        if res.package.manifest.driver_version != want.driver:
            raise PackageError(f"local build made {res.package.manifest.driver_version}, not {want.driver}",
                               cause=f"packages.source {source} is another driver version",
                               fix="point packages.source at the wanted version's source")
        return res.package.path
    if v is not None and v != want.driver:
        return None, f"packages.source {source} is driver {v}, not {want.driver}"
    return builder, None
