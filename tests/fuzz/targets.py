"""Fuzz targets for driverd's parsers of untrusted input (issue 21), shared by tests/test_fuzz.py
(a CI-sized run: a bounded number of examples per target, derandomized) and bench/fuzz.py (a longer
run that reports executions and findings).

The contract every target checks: the parser returns, or raises driverd's own error type
(driverd.errors.DriverdError) whose one-line rendering is exactly one line. Anything else — an
IndexError, a struct.error, a UnicodeError, a RecursionError, a message with a line break — is a
finding. Facts readers (/proc files, runtime configs read by detect) may not raise at all: absence or
oddity is a fact; their targets check the same contract, which a reader that never raises keeps.

Inputs are hypothesis strategies: random data plus *mutations of valid seeds* (byte flips,
insertions, deletions, truncations of a real signed module's PKCS#7, a real package, a real index,
real /proc lines), so the fuzzer gets past the first length check."""
from __future__ import annotations

import functools
import io
import json
import os
import struct
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hypothesis import strategies as st

from driverd.errors import DriverdError


class Finding(AssertionError):
    """The contract broken: what was raised (or printed) instead of one DriverdError line."""


def contract(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except DriverdError as e:
        line = e.one_line()
        if len(line.splitlines()) != 1 or not line.strip():
            raise Finding(f"{type(e).__name__} renders as {len(line.splitlines())} lines: {line[:200]!r}") from None
        return None


def one_line(text: str | None, what: str) -> None:
    if text is not None and len(text.splitlines()) > 1:
        raise Finding(f"{what} spans {len(text.splitlines())} lines: {text[:200]!r}")


# -- mutation of seeds ------------------------------------------------------------------------------

def _mutate(seed: bytes, ops: list[tuple[int, int, bytes]]) -> bytes:
    b = bytearray(seed)
    for op, pos, data in ops:
        pos = pos % (len(b) + 1)
        if op == 0:                                    # overwrite
            b[pos:pos + len(data)] = data
        elif op == 1:                                  # insert
            b[pos:pos] = data
        elif op == 2:                                  # delete
            del b[pos:pos + max(1, len(data))]
        elif op == 3:                                  # truncate
            del b[pos:]
        else:                                          # a length-ish byte set to an extreme
            if pos < len(b):
                b[pos] = 0xFF if data[:1] != b"\0" else 0x00
    return bytes(b)


_OPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.binary(min_size=0, max_size=24)),
                min_size=1, max_size=6)


def mutated(seeds: list[bytes], max_random: int = 2048) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=max_random), st.builds(_mutate, st.sampled_from(seeds), _OPS))


def mutated_text(seeds: list[str]) -> st.SearchStrategy[str]:
    raw = [s.encode() for s in seeds]
    return st.one_of(st.text(max_size=2000),
                     mutated(raw).map(lambda b: b.decode("utf-8", "replace")),
                     st.lists(st.sampled_from([ln for s in seeds for ln in s.splitlines()] or ["x"]) |
                              st.text(max_size=200), max_size=30).map("\n".join))


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=15), inner, max_size=5),
                    max_leaves=25)


# -- seeds (built once per process) -------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def seed_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="driverd-fuzz-seeds-"))


@functools.lru_cache(maxsize=None)
def pkcs7_seeds() -> tuple[bytes, ...]:
    """Real module signatures as sign-file makes them (CMS, no certificates, no attributes): by
    issuer+serial and by subjectKeyIdentifier."""
    from driverd.sim.fakemod import make_signing_key
    d = seed_dir() / "sig"
    d.mkdir(exist_ok=True)
    key, cert = make_signing_key(d)
    data = d / "data"
    data.write_bytes(b"\x7fELF" + b"\0" * 60)
    out = []
    for extra in ([], ["-keyid"]):
        r = subprocess.run(["openssl", "cms", "-sign", "-binary", "-noattr", "-nocerts", "-nosmimecap", "-outform",
                            "DER", "-md", "sha256", "-signer", str(cert), "-inkey", str(key), "-in", str(data),
                            *extra], capture_output=True, timeout=60, check=True)
        out.append(r.stdout)
    return tuple(out)


def trailer(sig: bytes, id_type: int = 2, signer: bytes = b"", key_id: bytes = b"") -> bytes:
    from driverd.package.modsig import SIG_MAGIC
    return signer + key_id + sig + struct.pack(">BBBBB3xI", 0, 4, id_type, len(signer), len(key_id), len(sig)) + \
        SIG_MAGIC


@functools.lru_cache(maxsize=None)
def package_seed() -> tuple[bytes, bytes]:
    """(the .tar.zst bytes, the tar inside) of a small real package."""
    import zstandard
    from driverd.sim.fakepkg import make_fake_package
    ref = make_fake_package(seed_dir() / "pkg", "535.261.03", "6.1.0-47-cloud-amd64", with_firmware=False)
    raw = ref.path.read_bytes()
    tar = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)).read()
    return raw, tar


@functools.lru_cache(maxsize=None)
def manifest_seed() -> bytes:
    with tarfile.open(fileobj=io.BytesIO(package_seed()[1])) as t:
        return t.extractfile("manifest.json").read()


@functools.lru_cache(maxsize=None)
def userspace_seed() -> tuple[bytes, bytes]:
    """(the .tar.zst bytes, its manifest.json) of a small user-space package."""
    from tests.packages.usfake import plain_package
    ref = plain_package(seed_dir() / "us")
    return ref.path.read_bytes(), ref.manifest.dumps()


@functools.lru_cache(maxsize=None)
def companion_seed() -> tuple[bytes, bytes, bytes, bytes]:
    """(NVIDIA's nscq archive as the build reads it, its redistrib JSON, the companion package's .tar.zst bytes,
    its manifest.json): tests/packages/companionfake.py's miniature."""
    from driverd.build.companion import build_from_archive
    from tests.packages import companionfake as cf
    d = seed_dir() / "companion"
    a = cf.archive(d, "nscq")
    js = cf.redistrib(d, [a])
    ref = build_from_archive(a, d / "out").ref
    return a.read_bytes(), js.read_bytes(), ref.path.read_bytes(), ref.manifest.dumps()


@functools.lru_cache(maxsize=None)
def index_seed() -> bytes:
    from driverd.repo.index import write_index
    raw, _ = package_seed()
    d = seed_dir() / "pkg"
    write_index(d)
    return (d / "index.json").read_bytes()


PROC_KEYS = """\
1f3a2c0b I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: 1
27a51a1e I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot CA: 6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1: X509.rsa 4c6c0d1f []
0e4f6d2c I------     1 perm 1f030000     0     0 asymmetri Canonical Ltd. Master Certificate Authority: ad91990bc22ab1f517048c23b6655a268e345a63: X509.rsa 8e345a63 []
3c5f0e6a I--Q---     2 perm 3f030000     0     0 keyring   .machine: 1
"""
PROC_MODULES = """\
nvidia_uvm 1888256 0 - Live 0x0000000000000000 (POE)
nvidia_drm 118784 0 - Live 0x0000000000000000 (POE)
nvidia_modeset 1306624 1 nvidia_drm, Live 0x0000000000000000 (POE)
nvidia 56717312 20 nvidia_uvm,nvidia_modeset,[permanent], Live 0xffffffffc0a00000 (POE)
video 65536 1 nvidia_modeset, Live 0x0000000000000000
"""
KMSG = [
    "[  912.441223] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  550.127.05  Release Build",
    "[  912.441301] NVRM: API mismatch: the client has the version 535.261.03, but",
    "NVRM: this kernel module has the version 550.127.05.  Please",
    "[  913.000001] nvidia: module verification failed: signature and/or required key missing - tainting kernel",
    "[  913.1] NVRM: GPU 0000:1b:00.0: RmInitAdapter failed! (0x62:0x40:2478)",
]
NVIDIA_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.127.05  Release Build  "
                  "(dvs-builder@U16-I3-B03-4-3)  Thu Oct 10 21:40:37 UTC 2024\nGCC version:  gcc version 12.2.0\n")
CONTAINERD = """\
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
  BinaryName = "/usr/bin/nvidia-container-runtime"
imports = ["/etc/containerd/conf.d/*.toml"]
"""
CRIO = """\
[crio.runtime]
default_runtime = "runc"
[crio.runtime.runtimes.nvidia]
runtime_path = "/usr/bin/nvidia-container-runtime"
runtime_type = "oci"
"""
DOCKER = json.dumps({"runtimes": {"nvidia": {"path": "/usr/bin/nvidia-container-runtime", "runtimeArgs": []}},
                     "default-runtime": "runc"}, indent=2)
ROLLOUT = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
           "metadata": {"name": "r1", "generation": 3, "uid": "u"},
           "spec": {"driver": "570.195.03", "flavor": "open", "maxParallel": 2, "maxUnavailable": "25%",
                    "canary": 1, "canarySoakSeconds": 60, "failureBudget": 1, "preflight": "Exclude",
                    "nodeSelector": {"matchLabels": {"gpu": "h100"},
                                     "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    "drain": {"podSelector": "app=train", "timeoutSeconds": 600, "force": False},
                    "waitForJobs": {"podSelector": "job=batch", "timeoutSeconds": 3600}}}


# -- the targets -------------------------------------------------------------------------------------

def t_module_signature(data: bytes) -> None:
    """The trailer and the PKCS#7 inside it (driverd/package/modsig.py), as read from a .ko."""
    from driverd.package.modsig import signature_of_bytes
    sig = contract(lambda: signature_of_bytes("m.ko", data))
    if sig is not None:
        one_line(sig.error, "ModuleSignature.error")
        for s in sig.signers:
            one_line(s.short(), "SignerId.short()")


def t_pkcs7(der: bytes) -> None:
    """PKCS#7 bytes under a well-formed trailer: the DER parser gets every byte."""
    t_module_signature(b"\x7fELF" + b"\0" * 60 + trailer(der))


def t_index(data: bytes) -> None:
    from driverd.repo.index import parse_index
    contract(lambda: parse_index(data, "https://repo.example/index.json"))


def t_index_json(doc: Any) -> None:
    t_index(json.dumps(doc).encode())


def t_manifest(data: bytes) -> None:
    from driverd.package.manifest import Manifest
    contract(lambda: Manifest.loads(data, "pkg: manifest.json"))


def t_userspace_manifest(data: bytes) -> None:
    from driverd.package.userspace import UserspaceManifest
    contract(lambda: UserspaceManifest.loads(data, "pkg: manifest.json"))


def t_userspace_archive(data: bytes) -> None:
    """A user-space package as downloaded: verified as one, and read as whichever kind it says it is."""
    from driverd.package.archive import read_manifest, verify_package
    p = _as_file(data)
    try:
        contract(lambda: verify_package(p, kind="userspace"))
        contract(lambda: read_manifest(p, kind=None))
    finally:
        os.unlink(p)


def t_companion_manifest(data: bytes) -> None:
    from driverd.package.companion import CompanionManifest
    contract(lambda: CompanionManifest.loads(data, "pkg: manifest.json"))


def t_companion_archive(data: bytes) -> None:
    """A companion package as downloaded: verified as one, and read as whichever kind it says it is."""
    from driverd.package.archive import read_manifest, verify_package
    p = _as_file(data)
    try:
        contract(lambda: verify_package(p, kind="companion"))
        contract(lambda: read_manifest(p, kind=None))
    finally:
        os.unlink(p)


def t_companion_source(data: bytes) -> None:
    """NVIDIA's archive as `driverd build-companion` reads it (xz + tar), under its name, into a throwaway
    output directory."""
    import shutil
    from driverd.build.companion import build_from_archive
    d = Path(tempfile.mkdtemp(prefix="fuzz-", dir=seed_dir()))
    try:
        a = d / "libnvidia_nscq-linux-x86_64-550.163.01-archive.tar.xz"
        a.write_bytes(data)
        contract(lambda: build_from_archive(a, d / "out"))
    finally:
        shutil.rmtree(d)


def t_redistrib(data: bytes) -> None:
    """NVIDIA's redistrib JSON, the archive it is asked about checked against it."""
    from driverd.build.companion import check_archive, parse_archive_name, redistrib_entry
    d = Path(tempfile.mkdtemp(prefix="fuzz-", dir=seed_dir()))
    try:
        js, a = d / "redistrib_550.163.01.json", d / "libnvidia_nscq-linux-x86_64-550.163.01-archive.tar.xz"
        js.write_bytes(data)
        a.write_bytes(companion_seed()[0])
        contract(lambda: check_archive(a, redistrib_entry(js, parse_archive_name(a.name))))
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def _as_file(data: bytes, suffix: str = ".tar.zst") -> str:
    fd, p = tempfile.mkstemp(prefix="fuzz-", suffix=suffix, dir=seed_dir())
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return p


def t_archive_file(data: bytes) -> None:
    """The package archive reader on the file as downloaded (zstd + tar)."""
    from driverd.package.archive import read_manifest, verify_package
    p = _as_file(data)
    try:
        contract(lambda: verify_package(p))
        contract(lambda: read_manifest(p))
    finally:
        os.unlink(p)


def t_archive_tar(tar: bytes) -> None:
    """The tar inside a well-formed zstd frame: every header field reaches tarfile and our checks."""
    import zstandard
    t_archive_file(zstandard.ZstdCompressor(level=1).compress(tar))


@functools.lru_cache(maxsize=None)
def _runtime_root() -> Path:
    r = seed_dir() / "rt"
    for d in ("etc/containerd/conf.d", "etc/crio", "etc/docker", "usr/bin"):
        (r / d).mkdir(parents=True, exist_ok=True)
    for b in ("containerd", "crio", "dockerd"):
        (r / "usr/bin" / b).write_text("")
    return r


def _runtime(hostpath: str, text: str) -> None:
    from driverd.host.runtimes import read_runtimes
    from driverd.root import Root
    root = _runtime_root()
    p = root / hostpath.lstrip("/")
    p.write_text(text, errors="surrogateescape")
    try:
        facts = contract(lambda: read_runtimes(Root(str(root))))
        for f in facts or ():
            one_line(f.note, "RuntimeFacts.note")
    finally:
        p.unlink()


def t_containerd(text: str) -> None:
    """containerd's config.toml: detect's reader and the writer's parser (tomlkit)."""
    from driverd.runtime import tomldoc
    _runtime("/etc/containerd/config.toml", text)
    contract(lambda: tomldoc.parse(text, "/etc/containerd/config.toml"))


def t_crio(text: str) -> None:
    _runtime("/etc/crio/crio.conf", text)


def t_docker(text: str) -> None:
    from driverd.runtime import jsondoc
    _runtime("/etc/docker/daemon.json", text)
    contract(lambda: jsondoc.parse(text, "/etc/docker/daemon.json"))


def t_proc_keys(text: str) -> None:
    from driverd.host.keyrings import parse_asymmetric, parse_proc_keys
    rows = contract(lambda: parse_proc_keys(text)) or []
    for r in rows:
        contract(lambda: parse_asymmetric(r["description"]))


def t_proc_modules(text: str) -> None:
    from driverd.host.modules import parse_proc_modules
    contract(lambda: parse_proc_modules(text))


def t_modinfo_elf(data: bytes) -> None:
    """The ELF .modinfo reader (driverd/modinfo.py read_modinfo) on a module file's bytes."""
    from driverd.modinfo import read_modinfo
    p = _as_file(data, ".ko")
    try:
        contract(lambda: read_modinfo(p))
    finally:
        os.unlink(p)


@functools.lru_cache(maxsize=None)
def elf_seeds() -> tuple[bytes, ...]:
    from driverd.sim.fakemod import elf_bytes, nvidia_modules
    return tuple(elf_bytes(m) for m in nvidia_modules()[:2])


def t_module_fields(data: bytes) -> None:
    """kmod's modinfo fields read from the file itself (driverd/package/modfields.py): .modinfo
    section plus signature trailer (kmod's own modinfo output is no longer parsed anywhere)."""
    from driverd.package.modfields import module_fields
    p = _as_file(data, ".ko")
    try:
        contract(lambda: module_fields(p))
    finally:
        os.unlink(p)


def t_ld_cache(data: bytes) -> None:
    """The host's /etc/ld.so.cache as driverd.driver.files reads it to find the driver's libraries."""
    from driverd.driver.files import parse_ld_cache
    for k, v in contract(lambda: parse_ld_cache(data)) or []:
        if not (isinstance(k, str) and isinstance(v, str) and v.startswith("/")):
            raise Finding(f"ld cache entry {k!r} -> {v!r}")


@functools.lru_cache(maxsize=None)
def ld_cache_seeds() -> tuple[bytes, ...]:
    """This machine's ld cache (read, never written) and a small one of two entries."""
    strings = b"libcuda.so.1\0/usr/local/nvidia/lib64/libcuda.so.1\0"
    head = b"glibc-ld.so.cache1.1" + struct.pack("<II", 2, len(strings)) + b"\0" * 20
    body = struct.pack("<iIIIQ", 0x0303, 96, 109, 0, 0) + struct.pack("<iIIIQ", 0x0303, 96, 96, 0, 0)
    real = Path("/etc/ld.so.cache")
    return (head + body + strings,) + ((real.read_bytes()[:1 << 16],) if real.is_file() else ())


def t_library_soname(data: bytes) -> None:
    """A driver library's DT_SONAME (driverd.driver.files.elf_soname) on the file's bytes."""
    from driverd.driver.files import elf_soname
    p = _as_file(data, ".so")
    try:
        name = contract(lambda: elf_soname(p))
        one_line(name, "soname")
    finally:
        os.unlink(p)


@functools.lru_cache(maxsize=None)
def shared_object_seeds() -> tuple[bytes, ...]:
    """Small shared objects of this machine (with a .dynamic section and a soname) and module ELFs."""
    libs = [Path(p) for p in ("/lib/x86_64-linux-gnu/libdl.so.2", "/usr/lib/x86_64-linux-gnu/libdl.so.2",
                              "/lib/x86_64-linux-gnu/libseccomp.so.2", "/lib64/libdl.so.2") if Path(p).is_file()]
    return tuple(p.read_bytes()[:1 << 17] for p in libs[:1]) + elf_seeds()


def t_kmsg(lines: list[str]) -> None:
    """Kernel log lines quoted into a load failure, and /proc/driver/nvidia/version."""
    from driverd.driver.ident import parse_version_file as parse_nvidia_version
    from driverd.kmod.kernel import kernel_error
    import io

    from driverd import log
    e = kernel_error("load", "nvidia", "Invalid argument", lines, "see dmesg")
    line = e.one_line()
    if len(line.splitlines()) != 1:
        raise Finding(f"kernel_error renders as {len(line.splitlines())} lines: {line[:200]!r}")
    # in a text log, the error is one line and each quoted kernel line one more (issue 32)
    buf = io.StringIO()
    log.reset()
    try:
        log.configure(stream=buf)
        log.log("driverd: error: " + line, "error", kernel_log=e.details["kernel_log"])
    finally:
        log.reset()
    if len(buf.getvalue().splitlines()) != 1 + len(e.details["kernel_log"]):
        raise Finding(f"{len(e.details['kernel_log'])} kernel lines render as {buf.getvalue()[:300]!r}")
    contract(lambda: parse_nvidia_version("\n".join(lines)))


def t_rollout(obj: Any) -> None:
    from driverd.cluster.model import Rollout
    r = contract(lambda: Rollout.from_object(obj))
    if r is not None:
        contract(lambda: r.key)


def _rollout_objects() -> st.SearchStrategy[Any]:
    """The valid spec with some fields replaced by arbitrary JSON, plus arbitrary JSON."""
    spec = ROLLOUT["spec"]

    def replace(obj: dict, path: list[str], value: Any) -> dict:
        out = json.loads(json.dumps(obj))
        cur = out
        for k in path[:-1]:
            if not isinstance(cur.get(k), dict):
                cur[k] = {}
            cur = cur[k]
        cur[path[-1]] = value
        return out
    paths = [["spec", k] for k in spec] + [["spec", "nodeSelector", "matchExpressions"],
                                           ["spec", "nodeSelector", "matchLabels"], ["spec", "drain", "timeoutSeconds"],
                                           ["spec", "drain", "force"], ["spec", "waitForJobs", "podSelector"],
                                           ["metadata", "generation"], ["metadata", "name"], ["metadata"], ["spec"]]
    edits = st.lists(st.tuples(st.sampled_from(paths), JSON), min_size=1, max_size=4)

    def apply(es):
        o = ROLLOUT
        for p, v in es:
            o = replace(o, p, v)
        return o
    return st.one_of(JSON, edits.map(apply))


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[Any], None]
    strategy: Callable[[], st.SearchStrategy[Any]]      # built lazily: seeds cost a subprocess or two


TARGETS = [
    Target("module-signature", t_module_signature,
           lambda: mutated([b"\x7fELF" + b"\0" * 60 + trailer(s) for s in pkcs7_seeds()] +
                           [b"\x7fELF" + trailer(b"", id_type=1, signer=b"Build key", key_id=b"\x01\x02")])),
    Target("pkcs7", t_pkcs7, lambda: mutated(list(pkcs7_seeds()))),
    Target("index.json-bytes", t_index, lambda: mutated([index_seed()])),
    Target("index.json-structure", t_index_json,
           lambda: st.one_of(JSON, st.builds(lambda d, k, v: {**d, k: v},
                                             st.just(json.loads(index_seed())), st.text(max_size=12), JSON))),
    Target("manifest", t_manifest, lambda: st.one_of(mutated([manifest_seed()]),
                                                     JSON.map(lambda o: json.dumps(o).encode()))),
    Target("archive-file", t_archive_file, lambda: mutated([package_seed()[0]], max_random=4096)),
    Target("archive-tar", t_archive_tar, lambda: mutated([package_seed()[1]], max_random=4096)),
    Target("userspace-manifest", t_userspace_manifest, lambda: st.one_of(mutated([userspace_seed()[1]]),
                                                                         JSON.map(lambda o: json.dumps(o).encode()))),
    Target("userspace-archive", t_userspace_archive, lambda: mutated([userspace_seed()[0]], max_random=4096)),
    Target("companion-manifest", t_companion_manifest, lambda: st.one_of(mutated([companion_seed()[3]]),
                                                                         JSON.map(lambda o: json.dumps(o).encode()))),
    Target("companion-archive", t_companion_archive, lambda: mutated([companion_seed()[2]], max_random=4096)),
    Target("companion-source", t_companion_source, lambda: mutated([companion_seed()[0]], max_random=4096)),
    Target("redistrib-json", t_redistrib, lambda: st.one_of(mutated([companion_seed()[1]]),
                                                            JSON.map(lambda o: json.dumps(o).encode()))),
    Target("containerd-toml", t_containerd, lambda: mutated_text([CONTAINERD])),
    Target("crio-toml", t_crio, lambda: mutated_text([CRIO])),
    Target("docker-json", t_docker, lambda: st.one_of(mutated_text([DOCKER]), JSON.map(json.dumps))),
    Target("proc-keys", t_proc_keys, lambda: mutated_text([PROC_KEYS])),
    Target("proc-modules", t_proc_modules, lambda: mutated_text([PROC_MODULES])),
    Target("module-fields", t_module_fields,
           lambda: mutated([e + trailer(s) for e in elf_seeds()[:1] for s in pkcs7_seeds()] + list(elf_seeds()))),
    Target("modinfo-elf", t_modinfo_elf, lambda: mutated(list(elf_seeds()))),
    Target("ld-so-cache", t_ld_cache, lambda: mutated(list(ld_cache_seeds()))),
    Target("library-soname", t_library_soname, lambda: mutated(list(shared_object_seeds()))),
    Target("kmsg-nvrm", t_kmsg, lambda: st.lists(mutated_text(KMSG + [NVIDIA_VERSION]), max_size=12)),
    Target("rollout-spec", t_rollout, _rollout_objects),
]
BY_NAME = {t.name: t for t in TARGETS}
