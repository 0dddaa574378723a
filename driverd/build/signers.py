"""Signer preflight: will the running kernel accept these modules' signatures?

Evidence, strongest first (docs/signing.md explains each):
1. a certificate the operator declares trusted (signing.trusted_certs, host paths under --root) that
   the signature names exactly (issuer + serial, or SKID) — the kernel's own match;
2. a key in the kernel's keyrings (/proc/keys + keyring membership, driverd.host.keyrings) whose
   SKID the signature names (sign-file -k), or whose description carries the signature's serial;
3. a key whose subject is the signature's issuer name: the kernel matches issuer + serial, which
   /proc/keys does not show, so this is a match by name (a different key of the same name would
   still be refused).

The kernel consults .builtin_trusted_keys and .secondary_trusted_keys (which links .machine, the MOK
keys on Linux >= 5.18) for modules (certs/system_keyring.c, VERIFY_USE_SECONDARY_KEYRING);
.platform (UEFI db, MOK on older kernels) is consulted only by distribution kernels that patch
module verification to fall back to it (Fedora/RHEL "integrity: allow platform keyring for module
signature verification", Ubuntu's equivalent) — reported, not relied on.

Under enforcement (sig_enforce, CONFIG_MODULE_SIG_FORCE, lockdown) an unsigned module or one whose
key is not found is refused: Linux >= 5.4 says EKEYREJECTED "Key was rejected by service" with
"Loading of unsigned module is rejected" / "Loading of module with unavailable key is rejected" in
the kernel log (kernel/module/signing.c module_sig_check); older kernels returned ENOKEY "Required
key not available". Without enforcement they load and taint the kernel (E).
"""
from __future__ import annotations

import os
from dataclasses import asdict

from driverd.datatypes import dataclass
from driverd.host.keyrings import BLACKLIST, BUILTIN, MACHINE, PLATFORM, SECONDARY, KeyringFacts
from driverd.package.modsig import CertIdentity, ModuleSignature, SignerId, signer_matches_cert

MODULE_KEYRINGS = (BUILTIN, SECONDARY, MACHINE)
REFUSED = "Key was rejected by service"


@dataclass(frozen=True)
class ModuleVerdict:
    """Whether the running kernel will accept one module's signature, and the evidence for it."""
    module: str
    status: str                  # trusted | platform | untrusted | unsigned | unknown | damaged
    evidence: str
    signer: str | None = None
    key_id: str | None = None
    hash_algo: str | None = None


@dataclass(frozen=True)
class SignerVerdict:
    """The signer preflight's verdict: will the running kernel accept these modules' signatures."""
    status: str                  # accepted | refused | unknown | not-enforced | not-checked
    summary: str
    enforced: bool
    blocks: bool
    source: str | None = None    # where the signatures were read (package file, installed tree, signing.cert)
    modules: tuple[ModuleVerdict, ...] = ()
    enrol: str | None = None     # the command that enrols the missing key
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return asdict(self)


def _where(rings: tuple[str, ...]) -> str:
    return ", ".join(rings) if rings else "the kernel's keys (keyring not known)"


def match(s: SignerId, keyrings: KeyringFacts, declared: list[CertIdentity], enforced: bool = True
          ) -> tuple[str, str]:
    """(status, evidence) for one SignerInfo."""
    refusal = f"the load would fail with '{REFUSED}'" if enforced else \
        "the kernel would load it tainted (E), as it does not enforce signatures"
    who = f"signed by '{' '.join((s.signer or '?').splitlines())}' {'key' if s.skid else 'serial'} {(s.key_id or '?')[:12]}…"
    for c in declared:
        if signer_matches_cert(s, c):
            return "trusted", f"{who}; matches the declared certificate {c.path} (signing.trusted_certs)"
    exact, by_name = [], []
    for k in keyrings.asymmetric():
        if s.skid and k.key_id == s.skid:
            exact.append(k)
        elif s.serial and k.key_id == s.serial and (k.name == s.signer or s.signer is None):
            exact.append(k)
        elif s.signer and k.name == s.signer:
            by_name.append(k)
    for found, how in ((exact, "found"), (by_name, "a key of that name is")):
        if not found:
            continue
        black = [k for k in found if BLACKLIST in k.keyrings]
        if black and how == "found":
            return "untrusted", f"{who}; the key is in {BLACKLIST}: {refusal}"
        good = [k for k in found if not k.keyrings or set(k.keyrings) & set(MODULE_KEYRINGS)]
        k = (good or found)[0]
        rings = tuple(r for r in k.keyrings if r != BLACKLIST)
        tail = "" if how == "found" else (f" (key {k.key_id[:12]}…; the kernel matches issuer and serial, which "
                                          "/proc/keys does not show)" if k.key_id else "")
        if good:
            return "trusted", f"{who}; {how} in {_where(rings)}{tail}"
        if PLATFORM in rings:
            return "platform", (f"{who}; {how} in {PLATFORM} only{tail}: distribution kernels that fall back to "
                                f"{PLATFORM} (RHEL, Fedora, Ubuntu) accept it, an upstream kernel refuses it")
    if not keyrings.keyrings and not declared:
        return "unknown", (f"{who}; the kernel's keyrings are not visible here and no certificate is declared in "
                           "signing.trusted_certs: cannot tell whether the kernel holds the key")
    return "untrusted", f"{who}; not found in any trusted keyring: {refusal}"


def judge(signatures: list[ModuleSignature], keyrings: KeyringFacts, declared: list[CertIdentity], *,
          enforced: bool, source: str | None = None, certs_for_enrol: list[CertIdentity] | None = None,
          notes: tuple[str, ...] = ()) -> SignerVerdict:
    mods: list[ModuleVerdict] = []
    for sig in signatures:
        if not sig.signed:
            mods.append(ModuleVerdict(sig.module, "unsigned",
                                      f"unsigned: the kernel refuses it under enforcement ('{REFUSED}', "
                                      "'Loading of unsigned module is rejected')" if enforced else
                                      "unsigned: loads with the kernel tainted (E)"))
            continue
        if sig.error or not sig.signers:
            mods.append(ModuleVerdict(sig.module, "damaged", f"the signature trailer is damaged ({sig.error}): "
                                      "the kernel refuses any module whose signature does not parse"))
            continue
        best = None
        for s in sig.signers:
            status, ev = match(s, keyrings, declared, enforced)
            if best is None or _rank(status) < _rank(best[0]):
                best = (status, ev, s)
        status, ev, s = best
        mods.append(ModuleVerdict(sig.module, status, ev, s.signer, s.key_id, s.hash_algo))
    bad = [m for m in mods if m.status in ("unsigned", "untrusted", "damaged")]
    unknown = [m for m in mods if m.status == "unknown"]
    enrol = None
    if bad and any(m.status == "untrusted" for m in bad):
        enrol = enrol_hint(bad, certs_for_enrol or [])
    if not mods:
        return SignerVerdict("not-checked", "no modules to check", enforced, False, source, notes=notes)
    if not enforced:
        summary = ("the kernel does not enforce module signatures; " +
                   (f"{len(bad)} module(s) would taint it (E): {bad[0].evidence}" if bad else
                    "every module's signer is trusted" if not unknown else unknown[0].evidence))
        return SignerVerdict("not-enforced", summary, False, False, source, tuple(mods), enrol, notes)
    if bad:
        m = bad[0]
        return SignerVerdict("refused", f"{m.module}: {m.evidence}", True, True, source, tuple(mods), enrol, notes)
    if unknown:
        return SignerVerdict("unknown", f"{unknown[0].module}: {unknown[0].evidence}", True, False, source,
                             tuple(mods), None, notes)
    return SignerVerdict("accepted", f"{mods[0].module}: {mods[0].evidence}", True, False, source, tuple(mods),
                         None, notes)


def _rank(status: str) -> int:
    return ("trusted", "platform", "unknown", "untrusted").index(status) if status in (
        "trusted", "platform", "unknown", "untrusted") else 9


def enrol_hint(bad: list[ModuleVerdict], certs: list[CertIdentity]) -> str:
    signer = next((m for m in bad if m.status == "untrusted"), bad[0])
    cert = next((c for c in certs if c.subject == signer.signer or c.serial == signer.key_id
                 or c.skid == signer.key_id), None)
    if cert is not None and cert.path:
        der = cert.path if cert.path.endswith((".der", ".cer", ".crt")) and not _is_pem(cert.path) else None
        if der:
            return f"enrol '{cert.subject}' as a MOK: mokutil --import {der}, reboot and confirm in MokManager"
        return (f"enrol '{cert.subject}' as a MOK: openssl x509 -in {cert.path} -outform DER -out mok.der && "
                "mokutil --import mok.der, reboot and confirm in MokManager")
    return (f"enrol the certificate of '{signer.signer or '?'}' (key {(signer.key_id or '?')[:12]}…) as a MOK: "
            "mokutil --import CERT.der, reboot and confirm in MokManager; or sign with an enrolled key "
            "([signing] key/cert)")


def _is_pem(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"-----BEGIN" in f.read(4096)
    except OSError:
        return False


# -- reading signatures --------------------------------------------------------------------------

def package_signatures(package: str | os.PathLike) -> list[ModuleSignature]:
    """The signature of every module in a package archive, read from the archive (nothing written)."""
    from driverd.package.archive import _open_stream, _stream_errors
    from driverd.package.manifest import MODULES_DIR
    from driverd.package.modsig import signature_of_bytes
    from driverd.errors import PackageError
    out = []
    try:
        with _open_stream(package) as tar:
            for ti in tar:
                if ti.isreg() and ti.name.startswith(MODULES_DIR + "/") and ".ko" in ti.name:
                    f = tar.extractfile(ti)
                    if f is not None and ti.size < (2 << 30):
                        out.append(signature_of_bytes(ti.name, f.read()))
    except _stream_errors() as e:
        raise PackageError(f"cannot read the modules of {os.path.basename(os.fspath(package))}: {e}",
                           cause="the archive is truncated or corrupt", fix="fetch or build it again") from None
    return out


def tree_signatures(directory: str | os.PathLike) -> list[ModuleSignature]:
    from driverd.package.modsig import read_signature
    d = os.fspath(directory)
    try:
        names = sorted(n for n in os.listdir(d) if ".ko" in n)
    except OSError:
        return []
    return [read_signature(os.path.join(d, n)) for n in names]


def declared_certs(root, paths: list[str] | None) -> tuple[list[CertIdentity], list[str]]:
    """Certificates from signing.trusted_certs (host paths under the root); problems as notes."""
    from driverd.package.modsig import read_certificates
    from driverd.root.nodefiles import node_path
    certs, notes = [], []
    for p in paths or []:
        try:
            certs += read_certificates(node_path(root, p, "signing.trusted_certs"))
        except (OSError, ValueError) as e:
            notes.append(f"signing.trusted_certs {p}: {getattr(e, 'strerror', None) or e}")
    return certs, notes


def signing_cert_signer(root, cert_path: str | None) -> list[ModuleSignature]:
    """The signatures a local build (signing.key/cert on this node) will carry: one per core module."""
    from driverd.package.modsig import read_certificates
    from driverd.root.nodefiles import node_path
    if not cert_path:
        return []
    try:
        c = read_certificates(node_path(root, cert_path, "signing.cert"))[0]
    except (OSError, ValueError):
        return []
    sid = SignerId(c.issuer_name, c.issuer, c.serial, None, "sha256", None)
    return [ModuleSignature("nvidia.ko", True, "PKCS#7", (sid,))]


def check(root, keyrings: KeyringFacts, signatures: list[ModuleSignature], cfg, *, enforced: bool,
          source: str | None) -> SignerVerdict:
    """judge() with the configuration's declared certificates and signing.cert as the enrol hint."""
    from driverd.package.modsig import read_certificates
    from driverd.root.nodefiles import node_path
    declared, notes = declared_certs(root, cfg["signing.trusted_certs"])
    hints = list(declared)
    if cfg["signing.cert"]:
        try:
            hints += read_certificates(node_path(root, cfg["signing.cert"], "signing.cert"))
        except (OSError, ValueError):
            pass
    return judge(signatures, keyrings, declared, enforced=enforced, source=source, certs_for_enrol=hints,
                 notes=tuple(notes) + keyrings.notes)


def for_plan(root, facts, cfg) -> SignerVerdict | None:
    """The verdict `driverd plan` / `apply` state: on the package that would be loaded, when its files
    are here (installed for the running kernel, or in the download cache), else on what a local build
    would sign with (signing.cert); else "not checked yet" (checked after the fetch, before anything
    is unloaded: the check-signers step)."""
    from driverd.host.keyrings import read_keyrings
    from driverd.package.manifest import package_basename
    from driverd.plan.flavor import decide
    k, version = facts.kernel, cfg["driver.version"]
    if not facts.gpus or not version or not k.release:
        return None
    flavor = decide(facts.gpus, version, cfg["driver.flavor"]).flavor
    d = facts.driver
    if flavor is None or (d.loaded and d.version == version and d.flavor == flavor):
        return None
    keyrings = facts.keyrings if facts.keyrings is not None else read_keyrings(root)
    enforced = k.module_signature_enforced
    sigs, source = [], None
    for p in d.installed:
        if (p.kernel_release, p.driver_version, p.flavor) == (k.release, version, flavor):
            tree = os.path.dirname(p.path)            # a host path: <release>/updates/driverd/manifest.json
            sigs, source = tree_signatures(root.real(tree)), f"installed {tree}"
            break
    if not sigs:
        try:
            cache = root.real(f"{cfg['packages.cache_dir']}/packages")      # resolved inside the root
            prefix = package_basename(version, flavor, k.release, k.arch or "x86_64") + "."
            cands = sorted((c for c in os.listdir(cache) if c.startswith(prefix) and c.endswith(".tar.zst")),
                           key=lambda c: os.stat(cache / c).st_mtime, reverse=True)
        except OSError:
            cands = []
        for c in cands:
            try:
                sigs, source = package_signatures(cache / c), f"cached package {c}"
                break
            except Exception:               # noqa: BLE001 - a damaged cache entry is fetched again
                continue
    if not sigs and cfg["signing.cert"] and cfg["packages.build_fallback"]:
        sigs = signing_cert_signer(root, cfg["signing.cert"])
        source = f"a local build signed with signing.cert {cfg['signing.cert']}" if sigs else None
    if not sigs:
        return SignerVerdict("not-checked", "the package is not here yet: its modules' signatures are checked "
                             "after the fetch, before anything is unloaded (check-signers)", enforced, False, None,
                             notes=keyrings.notes)
    return check(root, keyrings, sigs, cfg, enforced=enforced, source=source)
