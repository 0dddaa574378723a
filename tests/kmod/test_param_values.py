"""Parameter values as Debian's 6.1 kernel parses them (kstrto*, kstrtobool; checked in tests/vm)."""
from __future__ import annotations

import pytest

from driverd.kmod.load import value_problem
from driverd.sim.kernel import _param_error

CASES = [("uint", "010", None), ("uint", "08", "Invalid argument"), ("uint", "+7", None), ("uint", "-1", "Invalid argument"),
         ("uint", "4294967296", "Numerical result out of range"), ("ushort", "70000", "Numerical result out of range"),
         ("int", "-2147483648", None), ("int", "1e3", "Invalid argument"), ("bool", "false", None), ("bool", "no", None),
         ("bool", "off", None), ("bool", "2", "Invalid argument")]


@pytest.mark.parametrize("ptype,value,errno_text", CASES)
def test_values(ptype, value, errno_text):
    assert _param_error(ptype, value) == errno_text                     # the simulated kernel's answer
    assert (value_problem(ptype, value) is None) == (errno_text is None)   # driverd's pre-load check
