"""A marker-delimited block appended to a file we must not parse, e.g. the Go-template
config.toml.tmpl of k3s/RKE2: the template syntax around it stays exactly as it was."""
from __future__ import annotations


def begin(marker: str) -> str:
    return f"# driverd:begin {marker} (managed by driverd; `driverd runtime revert` removes it)"


def end(marker: str) -> str:
    return f"# driverd:end {marker}"


def has_block(text: str, marker: str) -> bool:
    return begin(marker) in text


def add_block(text: str, marker: str, body: str) -> str:
    """`text` with the block replaced (if present) or appended."""
    text = remove_block(text, marker)
    sep = "" if not text or text.endswith("\n") else "\n"
    return f"{text}{sep}{begin(marker)}\n{body.rstrip(chr(10))}\n{end(marker)}\n"


def remove_block(text: str, marker: str) -> str:
    b, e = begin(marker), end(marker)
    start = text.find(b)
    if start < 0:
        return text
    stop = text.find(e, start)
    if stop < 0:
        return text                     # an unterminated block is someone else's edit: leave it
    stop += len(e)
    if stop < len(text) and text[stop] == "\n":
        stop += 1
    return text[:start] + text[stop:]
