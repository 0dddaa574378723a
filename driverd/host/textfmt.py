"""Strict readers for the kernel's text formats: decimal numbers as printed by "%d"/"%u"/"%i",
booleans as the kernel's own kstrtobool() reads them. Python's int() and str.isdigit() accept far
more (underscores, Unicode digits such as '²', thousands of digits) and would turn junk in a
damaged tree into an exception or a wrong number."""
from __future__ import annotations

import re

_INT = re.compile(r"[+-]?[0-9]{1,20}")


def kernel_int(text: str | None, *, signed: bool = True) -> int | None:
    """The number in `text` (surrounding whitespace allowed), or None when it is not one."""
    if text is None:
        return None
    t = text.strip()
    if not _INT.fullmatch(t) or (not signed and t[0] in "+-"):
        return None
    return int(t)


def kstrtobool(text: str | None) -> bool | None:
    """lib/kstrtox.c kstrtobool(): y/Y/t/T/1 and "on" are true; n/N/f/F/0 and "off" are false."""
    if not text:
        return None
    c = text[0]
    if c in "yYtT1":
        return True
    if c in "nNfF0":
        return False
    if c in "oO" and len(text) > 1:
        if text[1] in "nN":
            return True
        if text[1] in "fF":
            return False
    return None
