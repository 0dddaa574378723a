"""Redaction of URL credentials (issues 21, 30), as properties: for ANY userinfo made of RFC 3986's
legal characters (unreserved, percent-encodings, sub-delims such as `'` `(` `)` `!` `;` `=`, and
`:`) — a raw `@` too — in any URL in any surrounding text (quoted, in JSON, in a Python repr, in a
log line, glued to punctuation), the userinfo is gone from what redact() returns and the rest of the
URL is kept. And the places that print: errors, the log, daemon.json and /readyz's body."""
from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from driverd.redact import redact, redact_obj

UNRESERVED = string.ascii_letters + string.digits + "-._~"
SUB_DELIMS = "!$&'()*+,;="
USERINFO_CHARS = UNRESERVED + SUB_DELIMS + ":"


def pct() -> st.SearchStrategy[str]:
    return st.builds(lambda a, b: f"%{a}{b}", st.sampled_from("0123456789ABCDEFabcdef"),
                     st.sampled_from("0123456789ABCDEFabcdef"))


# RFC 3986 §3.2.1: userinfo = *( unreserved / pct-encoded / sub-delims / ":" ); non-empty here.
userinfo = st.lists(st.one_of(st.sampled_from(USERINFO_CHARS), pct()), min_size=1, max_size=40).map("".join)
scheme = st.sampled_from(["http", "https", "HTTPS", "oci", "s3", "git+ssh", "file", "ftp"])
host = st.one_of(st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?(\.[a-z]{2,6}){0,2}", fullmatch=True),
                 st.just("[::1]"), st.just("10.0.0.7"))
port = st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))
rest = st.one_of(st.just(""), st.from_regex(r"/[A-Za-z0-9._~/-]{0,20}(\?[a-z]=[a-z0-9@]{0,5})?(#[a-z]{0,4})?",
                                            fullmatch=True))
# What a URL sits in: prose, quotes, JSON, a repr, a log field.
around = st.sampled_from([("", ""), ("GET ", ": HTTP 401"), ("'", "'"), ('"', '"'), ("<", ">"), ("(", ")"),
                          ("url=", " next"), ("[", ", 'file:///srv']"), ("see ", ".\n"), ("\t", "\r\n")])


@settings(max_examples=1500, deadline=None)
@given(scheme, userinfo, host, port, rest, around)
def test_any_legal_userinfo_is_removed(sch, ui, h, p, r, ar):
    url = f"{sch}://{ui}@{h}{p}{r}"
    text = f"{ar[0]}{url}{ar[1]}"
    out = redact(text)
    assert out == f"{ar[0]}{sch}://{h}{p}{r}{ar[1]}", (text, out)


@settings(max_examples=500, deadline=None)
@given(scheme, userinfo, userinfo, host, rest)
def test_a_raw_at_sign_in_the_password_is_removed_whole(sch, user, pw, h, r):
    text = f"{sch}://{user}:{pw}@x@{h}{r} done"
    assert redact(text) == f"{sch}://{h}{r} done"


@settings(max_examples=500, deadline=None)
@given(scheme, userinfo, host, port, rest)
def test_json_and_repr_carry_no_userinfo(sch, ui, h, p, r):
    url = f"{sch}://{ui}@{h}{p}{r}"
    clean = f"{sch}://{h}{p}{r}"
    doc = {"reason": f"fetch {url} failed", "list": [url, 1]}
    assert redact(json.dumps(doc)) == json.dumps({"reason": f"fetch {clean} failed", "list": [clean, 1]})
    assert redact(repr([url]))[2:-2] == clean          # ['…'] or ["…"] (when the userinfo has a ')
    assert redact_obj(doc) == {"reason": f"fetch {clean} failed", "list": [clean, 1]}


@settings(max_examples=800, deadline=None)
@given(st.text(max_size=80))
def test_arbitrary_text_only_ever_loses_characters_and_is_stable(t):
    out = redact(t)
    assert len(out) <= len(t) and redact(out) == out
    if "@" not in t:
        assert out == t


@pytest.mark.parametrize("text,want", [
    ("GET https://robot:pa'ss@mirror.example/repo/index.json: HTTP 401",
     "GET https://mirror.example/repo/index.json: HTTP 401"),
    ("'https://u:it's(me)!@h'", "'https://h'"),
    ('{"url": "https://u:p@h", "x": "a@b"}', '{"url": "https://h", "x": "a@b"}'),
    ("https://u:pä$$wörd@h/x", "https://h/x"),                         # an IRI's userinfo as well
    ("no url: mail root@localhost, /var/lib/x@y", "no url: mail root@localhost, /var/lib/x@y"),
    ("https://h/path@not-userinfo", "https://h/path@not-userinfo"),    # '@' after the authority
])
def test_examples(text, want):
    assert redact(text) == want


SECRET = "robot:s3'cr(e)t!"


def test_errors_and_the_log_never_carry_it(capfd):
    from driverd.errors import PackageError
    from driverd.log import log
    e = PackageError(f"GET https://{SECRET}@mirror.example/r/index.json: HTTP 401",
                     cause=f"see 'https://{SECRET}@mirror.example'", fix=f"check https://{SECRET}@m/")
    assert "s3'cr" not in e.one_line() + json.dumps(e.to_json()) + str(e)
    log(f"pass failed: {e.message}", reason=f"https://{SECRET}@mirror.example/x")
    out, err = capfd.readouterr()
    assert "s3'cr" not in out + err and "https://mirror.example/r/index.json" in err


def test_daemon_json_and_readyz_never_carry_it(tmp_path):
    from types import SimpleNamespace
    from driverd.apply import statefile
    from driverd.root import Root
    res = SimpleNamespace(state="failed", reason=f"GET https://{SECRET}@mirror.example/r/index.json: HTTP 401",
                          failure="fetch", started=1.0, finished=2.0, runs=[], loaded=None)
    statefile.write(Root(tmp_path), mode="daemon", result=res)
    text = (tmp_path / "run/driverd/daemon.json").read_text()
    assert "s3'cr" not in text and "https://mirror.example/r/index.json" in text
    from driverd.daemon.health import Health
    h = Health(lambda: None)
    h.set_state("failed", res.reason)
    ready, why = h.readiness()
    assert not ready and "s3'cr" not in why and "https://mirror.example/r/index.json" in why
