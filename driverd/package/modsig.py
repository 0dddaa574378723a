"""Who signed a kernel module, read from the `.ko` itself, and which kernel key that names.

The module signature trailer (include/linux/module_signature.h, scripts/sign-file.c) is appended to
the ELF file:

    [ELF module][signature: PKCS#7 DER][struct module_signature, 12 bytes]["~Module signature appended~\\n"]

    struct module_signature { u8 algo, hash, id_type, signer_len, key_id_len; u8 pad[3]; __be32 sig_len; }

Since Linux 4.3 `id_type` is PKEY_ID_PKCS7 (2) and the other fields are 0: who signed is inside the
PKCS#7 SignedData, in its SignerInfo's `sid`: the signing certificate's issuer Name and serial
number (sign-file's default), or its subjectKeyIdentifier (sign-file -k). sign-file leaves the
certificate itself out (CMS_NOCERTS), so nothing else names the key.

How the kernel finds the key (crypto/asymmetric_keys/pkcs7_trust.c, pkcs7_validate_trust_one): with
no certificates in the message, only "a trusted public key that matches the signed info directly" —
`find_asymmetric_key(keyring, sinfo->sig->auth_ids[0] ...)`, where auth_ids[0] is issuer+serial
(or the SKID). An X.509 key is registered with the ids serial+issuer and SKID
(x509_public_key.c), and described as "<subject>: <SKID hex, or serial hex without a SKID>", the
subject fabricated from CN and O (x509_cert_parser.c x509_fabricate_name): CN alone when it starts
with O (or both share their first 7 bytes), else "O: CN"; else CN, O or the e-mail address.

`kmod`'s modinfo shows the same: signer = the issuer's CN, sig_key = serial (or SKID) in hex.

PKCS#7 and X.509 are parsed with asn1crypto (pure Python, no compiled parts), imported lazily.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import asdict

from driverd.datatypes import dataclass

SIG_MAGIC = b"~Module signature appended~\n"
_SIG_STRUCT = struct.Struct(">BBBBB3xI")
PKEY_ID_PGP, PKEY_ID_X509, PKEY_ID_PKCS7 = 0, 1, 2
_ID_TYPES = {PKEY_ID_PGP: "PGP", PKEY_ID_X509: "X509", PKEY_ID_PKCS7: "PKCS#7"}
# include/crypto/hash_info.h order (the legacy trailer's `hash` byte)
_LEGACY_HASH = ("md4", "md5", "sha1", "rmd160", "sha256", "sha384", "sha512", "sha224")


@dataclass(frozen=True)
class SignerId:
    """One SignerInfo of a module signature: the key it names, as the kernel will look it up."""
    signer: str | None                  # the issuer name as the kernel fabricates it (what modinfo's signer shows)
    issuer: dict | None                 # issuer Name attributes (common_name, organization_name, ...)
    serial: str | None                  # lower-case hex, no separators (modinfo's sig_key)
    skid: str | None                    # subjectKeyIdentifier, when the signature names the key that way
    hash_algo: str | None               # sha256, sha512, ...
    sig_algo: str | None                # rsa, ecdsa, ...

    @property
    def key_id(self) -> str | None:
        return self.skid or self.serial

    def short(self) -> str:
        kid = self.key_id or "?"
        # The name comes from the module's own bytes (a legacy trailer or a certificate's CN): it
        # goes into one-line messages whatever it holds (found by fuzzing).
        signer = " ".join((self.signer or "?").splitlines())
        return f"'{signer}' {'skid' if self.skid else 'serial'} {kid[:12]}…"


@dataclass(frozen=True)
class ModuleSignature:
    """One module file's signature trailer as read from the file: whether it is signed, and by whom."""
    path: str
    signed: bool
    id_type: str | None = None          # PKCS#7 (every kernel since 4.3), X509/PGP (older)
    signers: tuple[SignerId, ...] = ()
    error: str | None = None            # a trailer that is present but cannot be parsed

    @property
    def module(self) -> str:
        from driverd.modinfo import module_name
        return module_name(self.path)

    def to_json(self) -> dict:
        return {**asdict(self), "module": self.module}


@dataclass(frozen=True)
class CertIdentity:
    """What a certificate contributes to a keyring: the ids the kernel registers it under and the
    description /proc/keys shows."""
    subject: str                        # fabricated like the kernel
    issuer_name: str
    issuer: dict
    serial: str                         # lower-case hex
    skid: str | None
    self_signed: bool
    path: str | None = None

    @property
    def description(self) -> str:
        return f"{self.subject}: {self.skid or self.serial}"

    def to_json(self) -> dict:
        return {**asdict(self), "description": self.description}


def _serial_bytes_hex(serial: int) -> str:
    """The serial as the DER INTEGER's content bytes (what the kernel keeps as raw_serial)."""
    return serial.to_bytes(max(1, (serial.bit_length() + 8) // 8), "big", signed=True).hex()


def fabricate_name(attrs: dict | None) -> str:
    """crypto/asymmetric_keys/x509_cert_parser.c x509_fabricate_name(), from Name attributes."""
    if not attrs:
        return ""

    def val(key: str) -> str | None:
        v = attrs.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        return str(v) if v else None
    cn, o, email = val("common_name"), val("organization_name"), val("email_address")
    if cn and o:
        cb, ob = cn.encode(), o.encode()
        if len(cb) >= len(ob) and cb[:len(ob)] == ob:
            return cn
        if len(cb) >= 7 and len(ob) >= 7 and cb[:7] == ob[:7]:
            return cn
        return f"{o}: {cn}"
    return cn or o or email or ""


# -- the trailer ----------------------------------------------------------------------------------

def split_trailer(data: bytes) -> tuple[bytes, dict] | None:
    """(signature bytes, header fields) of a signed module's data; None when no trailer is appended.
    Raises ValueError for a trailer whose lengths do not fit the file."""
    if not data.endswith(SIG_MAGIC):
        return None
    end = len(data) - len(SIG_MAGIC)
    if end < _SIG_STRUCT.size:
        raise ValueError("signature trailer is truncated")
    algo, hash_, id_type, signer_len, key_id_len, sig_len = _SIG_STRUCT.unpack_from(data, end - _SIG_STRUCT.size)
    start = end - _SIG_STRUCT.size - sig_len - signer_len - key_id_len
    if start < 0:
        raise ValueError(f"signature lengths ({sig_len}+{signer_len}+{key_id_len}) exceed the file")
    body = data[start:end - _SIG_STRUCT.size]
    hdr = {"algo": algo, "hash": hash_, "id_type": id_type, "signer": body[:signer_len],
           "key_id": body[signer_len:signer_len + key_id_len], "module_len": start}
    return body[signer_len + key_id_len:], hdr


def parse_pkcs7(der: bytes) -> tuple[SignerId, ...]:
    """The SignerInfos of a module's PKCS#7/CMS SignedData (no certificates needed)."""
    from asn1crypto import cms
    try:
        ci = cms.ContentInfo.load(der)
        if ci["content_type"].native != "signed_data":
            raise ValueError(f"content type {ci['content_type'].native}, not signed_data")
        infos = ci["content"]["signer_infos"]
        out = []
        for si in infos:
            sid = si["sid"]
            digest = si["digest_algorithm"]["algorithm"].native
            try:
                sig_algo = si["signature_algorithm"].signature_algo
            except (ValueError, KeyError):
                sig_algo = si["signature_algorithm"]["algorithm"].native
            if sid.name == "issuer_and_serial_number":
                issuer = sid.chosen["issuer"]
                attrs = dict(issuer.native)
                serial = sid.chosen["serial_number"].native
                out.append(SignerId(fabricate_name(attrs), attrs, _serial_bytes_hex(serial), None, digest, sig_algo))
            else:
                out.append(SignerId(None, None, None, bytes(sid.chosen.native).hex(), digest, sig_algo))
        return tuple(out)
    except ValueError:
        raise
    except Exception as e:            # asn1crypto raises assorted types for malformed DER
        raise ValueError(f"the PKCS#7 signature does not parse ({e.__class__.__name__}: {e})") from None


def signature_of_bytes(path: str, data: bytes) -> ModuleSignature:
    try:
        parts = split_trailer(data)
    except ValueError as e:
        return ModuleSignature(path, True, None, (), _one_line(e))
    if parts is None:
        return ModuleSignature(path, False)
    sig, hdr = parts
    id_type = _ID_TYPES.get(hdr["id_type"], f"unknown ({hdr['id_type']})")
    if hdr["id_type"] != PKEY_ID_PKCS7:
        # Linux < 4.3: the signer's name and key id are in the trailer itself.
        h = hdr["hash"]
        signer = SignerId(hdr["signer"].decode("utf-8", "replace") or None, None, None,
                          hdr["key_id"].hex() or None, _LEGACY_HASH[h] if h < len(_LEGACY_HASH) else None, None)
        return ModuleSignature(path, True, id_type, (signer,))
    try:
        return ModuleSignature(path, True, id_type, parse_pkcs7(sig))
    except ValueError as e:
        return ModuleSignature(path, True, id_type, (), _one_line(e))


def _one_line(e: BaseException) -> str:
    """asn1crypto's messages span lines ("...\n    while parsing ..."): the error goes into one-line
    messages (found by fuzzing)."""
    return " ".join(str(e).split())


def read_signature(path: str | os.PathLike) -> ModuleSignature:
    """The signature of a module file (.ko, .ko.xz, .ko.zst, .ko.gz). Raises OSError when unreadable."""
    from driverd.modinfo import module_bytes
    p = os.fspath(path)
    try:
        data = module_bytes(p)
    except ValueError as e:           # a damaged compressed file is reported, not raised
        return ModuleSignature(p, False, None, (), str(e))
    return signature_of_bytes(p, data)


# -- certificates -----------------------------------------------------------------------------------

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.S)


def certificates_in(data: bytes) -> list[bytes]:
    """DER certificates in a PEM bundle or a single DER certificate."""
    import base64
    found = [base64.b64decode(b"".join(m.group(1).split())) for m in _PEM.finditer(data)]
    return found if found else ([data] if data[:1] == b"\x30" else [])


def cert_identity(der: bytes, path: str | None = None) -> CertIdentity:
    """Raises ValueError for bytes that are not an X.509 certificate."""
    from asn1crypto import x509
    try:
        c = x509.Certificate.load(der)
        tbs = c["tbs_certificate"]
        subj, iss = dict(tbs["subject"].native), dict(tbs["issuer"].native)
        skid = c.key_identifier
        return CertIdentity(fabricate_name(subj), fabricate_name(iss), iss, _serial_bytes_hex(tbs["serial_number"].native),
                            skid.hex() if skid else None, tbs["subject"] == tbs["issuer"], path)
    except Exception as e:            # noqa: BLE001
        raise ValueError(f"not an X.509 certificate ({e.__class__.__name__}: {e})") from None


def read_certificates(path: str | os.PathLike) -> list[CertIdentity]:
    """Every certificate in a file (PEM, possibly several, or DER). Raises OSError/ValueError."""
    p = os.fspath(path)
    with open(p, "rb") as f:
        data = f.read(1 << 20)
    ders = certificates_in(data)
    if not ders:
        raise ValueError("no certificate found (expected PEM or DER)")
    return [cert_identity(d, p) for d in ders]


def signer_matches_cert(s: SignerId, c: CertIdentity) -> bool:
    """The kernel's direct match: the SignerInfo names this certificate by issuer+serial or by SKID."""
    if s.skid:
        return c.skid is not None and s.skid == c.skid
    return s.serial is not None and s.serial == c.serial and (s.issuer or {}) == (c.issuer or {})
