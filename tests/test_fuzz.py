"""The parsers of untrusted input under a CI-sized fuzz run (issue 21): every target in
tests/fuzz/targets.py gets a bounded number of hypothesis examples (random data and mutations of
valid seeds: a real module signature, package, index, /proc lines, runtime configs, a rollout), and
must only ever return or raise driverd's own error type rendered on one line. Derandomized, so a CI
run is repeatable; bench/fuzz.py runs the same targets for longer with fresh seeds. 100 examples a
target (DRIVERD_FUZZ_EXAMPLES), a few seconds each, about a minute in all."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz.targets import TARGETS

EXAMPLES = int(os.environ.get("DRIVERD_FUZZ_EXAMPLES", "100"))


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_parser_only_raises_driverds_own_one_line_errors(target):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(target.strategy())
    def run(data):
        target.run(data)
    run()


# The findings of the fuzz runs so far, fixed, kept as fixed examples (each failed before its fix).
FOUND = [
    ("pkcs7", b"0\x00"),                                          # asn1crypto's two-line message
    ("kmsg-nvrm", ["\x85", ""]),                                  # NEL: a line break one_line() kept
    ("kmsg-nvrm", ["NVRM: a\rb", "c\u2028d"]),
    ("module-signature", b"\x7fELF" + __import__("tests.fuzz.targets", fromlist=["trailer"]).trailer(
        b"", id_type=1, signer=b"\n", key_id=b"")),               # a legacy signer name with a newline
    ("rollout-spec", {"spec": {"driver": "570.195.03", "maxParallel": []}}),     # TypeError
    ("rollout-spec", {"spec": {"driver": "570.195.03", "nodeSelector": [1]}}),   # AttributeError
    ("rollout-spec", {"spec": {"driver": "570.195.03", "maxUnavailable": ""}}),
    ("rollout-spec", []),
    ("containerd-toml", 'version = 2\n[a]\nx = 1\n[a]\ny = 2\n'),  # tomlkit's KeyAlreadyPresent
    ("containerd-toml", 'a = 1\na = 2\n'),
    ("modinfo-elf", b"\x7fELF"),                                   # IndexError walking a truncated header
    ("modinfo-elf", b"\x7fELF\x02\x01" + b"\0" * 0x20 + (10).to_bytes(8, "little") + b"\0" * 14
     + (64).to_bytes(2, "little") + (1).to_bytes(2, "little") + (5).to_bytes(2, "little")),
    ("modinfo-elf", b"\x7fELF\x02\x01" + b"\0" * 0x22 + b"\xff" * 8 + b"\0" * 14      # OverflowError: e_shoff
     + (64).to_bytes(2, "little") + (1).to_bytes(2, "little") + (0).to_bytes(2, "little") + b"\0" * 64),
]


@pytest.mark.parametrize("name,data", FOUND, ids=[f"{n}-{i}" for i, (n, _) in enumerate(FOUND)])
def test_earlier_findings_stay_fixed(name, data):
    from tests.fuzz.targets import BY_NAME
    BY_NAME[name].run(data)
