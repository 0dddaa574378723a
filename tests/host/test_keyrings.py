"""The keyrings reader on /proc/keys in the kernel's own format (security/keys/proc.c,
crypto/asymmetric_keys/asymmetric_type.c) as Debian, Ubuntu and RHEL kernels print it, the live
machine read-only, and a captured tree's membership record."""
from __future__ import annotations

import json

from driverd.host.keyrings import (BUILTIN, CAPTURE_PATH, MACHINE, PLATFORM, SECONDARY, parse_asymmetric,
                                   parse_proc_keys, read_keyrings)
from driverd.package.modsig import SignerId, fabricate_name
from driverd.build.signers import match
from driverd.root import Root

# Lines as the kernel prints them (uid 0 reader). Debian 12 (6.1, Secure Boot: .platform holds the
# UEFI db, .builtin_trusted_keys the Debian CA); Ubuntu 24.04 (6.8: .machine holds MOK keys);
# RHEL 9 (5.14: the build key and Red Hat's CAs).
DEBIAN = """\
06ac5b0b I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: 1
0fd7c0d7 I------     1 perm 1f0f0000     0     0 keyring   .secondary_trusted_keys: 1
1b7f3c6a I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot CA: 6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1: X509.rsa bb419ea1 []
2a0c5d8e I------     1 perm 1f0b0000     0     0 keyring   .platform: 2
31a3f2b4 I------     1 perm 1f010000     0     0 asymmetri Microsoft Corporation UEFI CA 2011: 13adbf4309bd82709c8cd54f316ed522988a1bd4: X509.rsa 988a1bd4 []
3c6e84d9 I------     1 perm 1f010000     0     0 asymmetri Microsoft Windows Production PCA 2011: a92902398e16c49778cd90f99e4f9ae17c55af53: X509.rsa 7c55af53 []
3e1f1d2b I------     1 perm 1f030000     0     0 keyring   .blacklist: 1
"""
UBUNTU = """\
0a9a7c5e I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: 2
0c5f9f66 I------     1 perm 1f010000     0     0 asymmetri Canonical Ltd. Kernel Module Signing: 88f752e560a1e0737e31163a466ad7b70a850c19: X509.rsa 0a850c19 []
19e6a4a3 I------     1 perm 1f0f0000     0     0 keyring   .secondary_trusted_keys: 2
2b3f0c12 I------     1 perm 1f010000     0     0 asymmetri Canonical Ltd. Master Certificate Authority: ad91990bc22ab1f517048c23b6655a268e345a63: X509.rsa 8e345a63 []
37d15f3c I------     1 perm 1f0b0000     0     0 keyring   .machine: 1
3a8d2e65 I------     1 perm 1f010000     0     0 asymmetri gpu-fleet MOK: 4f3c9a8e7d6b5a4f3c2b1a0f9e8d7c6b5a4f3e2d: X509.rsa 5a4f3e2d []
"""
RHEL = """\
0336b39c I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: 4
10d1d0f5 I------     1 perm 1f010000     0     0 asymmetri Red Hat Enterprise Linux kernel signing key: 3a0e5d8c2f1e7b6d5c4b3a29180716f5e4d3c2b1: X509.rsa e4d3c2b1 []
14c9a2e3 I------     1 perm 1f010000     0     0 asymmetri Red Hat Enterprise Linux Driver Update Program (key 3): bf57f3e87362bc7229d9f465321773dfd1f77a80: X509.rsa d1f77a80 []
2dd0b1f2 I------     1 perm 1f0b0000     0     0 keyring   .platform: empty
"""


def _root(tmp_path, text: str, members: dict | None = None) -> Root:
    (tmp_path / "proc").mkdir(parents=True)
    (tmp_path / "proc/keys").write_text(text)
    if members is not None:
        p = tmp_path / CAPTURE_PATH.lstrip("/")
        p.parent.mkdir(parents=True)
        p.write_text(json.dumps({"members": members}))
    return Root(str(tmp_path))


def test_parse_lines_and_descriptions():
    rows = parse_proc_keys(DEBIAN)
    assert [r["type"] for r in rows][:3] == ["keyring", "keyring", "asymmetri"]
    r = rows[2]
    assert (r["serial"], r["flags"], r["usage"], r["timeout"], r["perm"], r["uid"]) == \
        ("1b7f3c6a", "I------", 1, "perm", "1f010000", 0)
    d, name, kid, kind = parse_asymmetric(r["description"])
    assert (name, kid, kind) == ("Debian Secure Boot CA", "6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1", "X509.rsa")
    # a subject that itself contains ": " (O: CN, from x509_fabricate_name)
    d, name, kid, _ = parse_asymmetric("Acme Corp: GPU signing: 0badc0de: X509.ecdsa 0badc0de []")
    assert (name, kid) == ("Acme Corp: GPU signing", "0badc0de")


def test_fabricated_names_follow_the_kernel():
    assert fabricate_name({"common_name": "Canonical Ltd. Kernel Module Signing",
                           "organization_name": "Canonical Ltd."}) == "Canonical Ltd. Kernel Module Signing"
    assert fabricate_name({"common_name": "GPU signing", "organization_name": "Acme Corp"}) == "Acme Corp: GPU signing"
    assert fabricate_name({"common_name": "Red Hat Enterprise Linux kernel signing key",   # CN starts with O
                           "organization_name": "Red Hat"}) == "Red Hat Enterprise Linux kernel signing key"
    assert fabricate_name({"common_name": "NVIDIA Corporation GPU", "organization_name": "NVIDIA Corp."}) == \
        "NVIDIA Corporation GPU"                                  # the first 7 bytes agree
    assert fabricate_name({"organization_name": "Only O"}) == "Only O"


def test_membership_from_a_capture(tmp_path):
    k = read_keyrings(_root(tmp_path, UBUNTU, {"3a8d2e65": [MACHINE, SECONDARY],
                                               "0c5f9f66": [BUILTIN, SECONDARY], "2b3f0c12": [BUILTIN, SECONDARY]}))
    assert k.readable and k.membership == "capture"
    assert set(k.keyrings) == {BUILTIN, SECONDARY, MACHINE}
    mok = next(x for x in k.keys if x.name == "gpu-fleet MOK")
    assert mok.keyrings == (MACHINE, SECONDARY)
    s = SignerId("gpu-fleet MOK", {"common_name": "gpu-fleet MOK"}, "01ab", None, "sha256", None)
    status, ev = match(s, k, [])
    assert status == "trusted" and "a key of that name is in .machine" in ev and "issuer and serial" in ev
    s2 = SignerId("someone else", {}, "02", None, "sha256", None)
    status, ev = match(s2, k, [])
    assert status == "untrusted" and "Key was rejected by service" in ev
    s3 = SignerId(None, None, None, "4f3c9a8e7d6b5a4f3c2b1a0f9e8d7c6b5a4f3e2d", "sha512", None)
    assert match(s3, k, [])[0] == "trusted"                    # by SKID: exact


def test_platform_only_key_is_reported_as_distribution_dependent(tmp_path):
    k = read_keyrings(_root(tmp_path, DEBIAN, {"31a3f2b4": [PLATFORM], "1b7f3c6a": [BUILTIN, SECONDARY]}))
    s = SignerId("Microsoft Corporation UEFI CA 2011", {}, "61", None, "sha256", None)
    status, ev = match(s, k, [])
    assert status == "platform" and "upstream kernel refuses it" in ev


def test_unknown_membership_still_matches_keys(tmp_path):
    k = read_keyrings(_root(tmp_path, RHEL))
    assert k.membership == "unknown" and any("keyring" in n for n in k.notes)
    s = SignerId("Red Hat Enterprise Linux kernel signing key", {}, "44", None, "sha256", None)
    status, ev = match(s, k, [])
    assert status == "trusted" and "keyring not known" in ev


def test_invisible_keyrings_mean_unknown_not_refused(tmp_path):
    # what an unprivileged reader sees: only its own keyrings
    k = read_keyrings(_root(tmp_path, "0dc59558 I--Q---     2 perm 1f3f0000  1000  1000 keyring   _uid.1000: empty\n"))
    assert not k.keyrings and any("uid 0" in n for n in k.notes)
    status, ev = match(SignerId("x", {}, "01", None, "sha256", None), k, [])
    assert status == "unknown" and "cannot tell" in ev


def test_missing_proc_keys(tmp_path):
    k = read_keyrings(Root(str(tmp_path)))
    assert not k.readable and k.membership == "unknown"


def test_live_machine_read_only():
    """This machine's own /proc/keys, read with keyctl(KEYCTL_READ) for membership: never changes anything."""
    import os
    before = open("/proc/keys").read() if os.path.exists("/proc/keys") else None
    k = read_keyrings(Root("/"))
    if before is None:
        assert not k.readable
        return
    assert k.readable and k.membership in ("keyctl", "unknown")
    if os.geteuid() == 0:
        assert BUILTIN in k.keyrings
    # the same keys with the same flags, permissions and descriptions; usage counts (3rd column) and session
    # keyrings are not ours to hold still: other processes (the suite's parallel workers) make and join them
    def keys(text: str) -> list[list[str]]:
        return [f[:2] + f[3:] for f in (line.split() for line in text.splitlines())
                if not (len(f) > 8 and f[8].startswith("_ses"))]
    assert keys(open("/proc/keys").read()) == keys(before)
