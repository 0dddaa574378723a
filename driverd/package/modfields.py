"""kmod's `modinfo FILE` fields, read from the module file itself: the ELF `.modinfo` strings
(driverd.modinfo) and the appended signature (driverd.package.modsig). No subprocess and no kmod,
so packaging and installing work in a minimal container and on a host without kmod.

The fields are those kmod 30 prints (checked against it on real modules in tests/test_modfields.py):

- every `.modinfo` string in section order (name, version, license, vermagic, srcversion, depends,
  firmware, alias, ...); values are stripped of surrounding blanks, as a line of modinfo's output
  reads (vermagic ends with a blank in the section);
- then the signature: sig_id (PKCS#7, X509, PGP), signer (the issuer's commonName, as kmod shows it;
  for the legacy trailer its signer string), sig_key (the serial number's minimal big-endian bytes,
  or the legacy key id, as colon-separated upper-case hex), sig_hashalgo (sha256, ...);
- then `parm`: one per parameter, 'NAME:DESCRIPTION (TYPE)' ('NAME:DESCRIPTION' without a declared
  type, 'NAME:TYPE' without a description), the parameters in reverse order of first appearance,
  the last description of a name winning — kmod's own layout.

One deliberate difference: a signature that names its key by subjectKeyIdentifier (sign-file -k) is
shown by kmod as no signature at all; here it gets sig_id, sig_key (the SKID) and sig_hashalgo, and no
signer (the signature does not name one). kmod's `signature` hex dump is not reproduced (nothing in
driverd reads it).
"""
from __future__ import annotations

import os
from typing import Sequence

from driverd.errors import PackageError
from driverd.modinfo import modinfo_of_bytes, module_bytes
from driverd.package.modsig import ModuleSignature, signature_of_bytes

Fields = dict[str, list[str]]


def _hex(hexstr: str) -> str:
    return ":".join(hexstr[i:i + 2] for i in range(0, len(hexstr), 2)).upper()


def _minimal(hexstr: str) -> str:
    """A serial's content bytes as an unsigned big number's minimal bytes (the DER INTEGER's leading
    00 of a serial with its top bit set is dropped, as kmod prints it)."""
    n = int(hexstr, 16) if hexstr else 0
    return n.to_bytes(max(1, (n.bit_length() + 7) // 8), "big").hex()


def signature_fields(sig: ModuleSignature) -> Fields:
    if not sig.signed or sig.id_type is None:
        return {}
    out: Fields = {"sig_id": [sig.id_type]}
    if not sig.signers:          # a trailer that does not parse: kmod names nothing either
        return out
    s = sig.signers[0]
    if sig.id_type != "PKCS#7":   # legacy trailer: signer and key id are written in it
        out["signer"] = [s.signer or ""]
    elif s.issuer is not None:
        cn = s.issuer.get("common_name")
        out["signer"] = [str(cn[0] if isinstance(cn, list) and cn else cn or "")]
    key = _hex(_minimal(s.serial)) if s.serial is not None else _hex(s.skid or "")
    out["sig_key"] = [key]
    out["sig_hashalgo"] = [s.hash_algo or "unknown"]
    return out


def _parm_lines(pairs: list[tuple[str, str]]) -> list[str]:
    descs: dict[str, str] = {}
    types: dict[str, str] = {}
    order: list[str] = []
    for k, v in pairs:
        n, _, rest = v.partition(":")
        if n not in order:
            order.append(n)
        (descs if k == "parm" else types)[n] = rest
    out = []
    for n in reversed(order):
        d, t = descs.get(n), types.get(n)
        out.append(f"{n}:{d} ({t})" if d is not None and t is not None else f"{n}:{d if d is not None else t}")
    return out


def fields_of_bytes(path: str, data: bytes) -> Fields:
    """Raises ValueError for bytes that are not a kernel module."""
    info = modinfo_of_bytes(path, data)
    out: Fields = {"filename": [path]}
    parms = []
    for k, v in info.fields:
        if k in ("parm", "parmtype"):
            parms.append((k, v))
        else:
            out.setdefault(k, []).append(v.strip())
    out.update(signature_fields(signature_of_bytes(path, data)))
    if parms:
        out["parm"] = _parm_lines(parms)
    return out


def module_fields(path: str | os.PathLike) -> Fields:
    """kmod's `modinfo PATH` fields for one module file (.ko, .ko.xz, .ko.zst, .ko.gz).
    Raises PackageError for a file that is missing, damaged or not a kernel module."""
    p = os.fspath(path)
    try:
        return fields_of_bytes(p, module_bytes(p))
    except OSError as e:
        raise PackageError(f"cannot read module {p}: {e.strerror or e}", cause=str(e),
                           fix="check the file and its permissions") from None
    except ValueError as e:
        raise PackageError(f"{os.path.basename(p)} is not a readable kernel module: {e}",
                           cause="the .ko file is damaged or not a kernel module", fix="rebuild the package") from None


def modinfo(paths: Sequence[str | os.PathLike]) -> dict[str, Fields]:
    """realpath -> fields for every module file."""
    return {os.path.realpath(p): module_fields(p) for p in paths}


def first(fields: Fields, key: str) -> str | None:
    v = fields.get(key)
    return v[0] if v else None
