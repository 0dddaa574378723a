"""driverd.datatypes.dataclass behaves as the standard library's: the same equality, hash and repr (its
methods are shared instead of compiled for each class), the same frozen errors, the same fields."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import field

import pytest

from driverd import datatypes

KINDS = [dict(), dict(frozen=True)]


def _pair(kw: dict, body):
    """The same class made by both decorators."""
    return dataclasses.dataclass(**kw)(body()), datatypes.dataclass(**kw)(body())


def _plain():
    class P:
        a: int
        b: str = "x"
        c: tuple = ()
        skip: int = field(default=0, compare=False)
        quiet: str = field(default="q", repr=False)
        nohash: int = field(default=1, hash=False)
        onlyhash: int = field(default=2, compare=False, hash=True)
    return P


def _one():
    class One:
        only: int
    return One


def _none():
    class Nothing:
        pass
    return Nothing


@pytest.mark.parametrize("kw", KINDS, ids=["mutable", "frozen"])
def test_equality_hash_and_repr_are_the_standard_ones(kw):
    for body, args in ((_plain, [(1,), (1, "y", (2,), 5, "z", 9, 7), (2,)]), (_one, [(1,), (2,)]), (_none, [()])):
        std, ours = _pair(kw, body)
        for x in args:
            for y in args:
                assert (std(*x) == std(*y)) == (ours(*x) == ours(*y))
                assert (std(*x) != std(*y)) == (ours(*x) != ours(*y))
            assert repr(std(*x)) == repr(ours(*x))
            if kw.get("frozen"):
                assert hash(std(*x)) == hash(ours(*x))
            else:
                with pytest.raises(TypeError):
                    hash(ours(*x))
        # another class, even one with the same fields, is not equal; a tuple is not either
        assert ours(*args[0]) != std(*args[0]) and ours(*args[0]) != args[0]
        assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(std)]
        assert ours.__match_args__ == std.__match_args__


def test_fields_left_out_of_comparison_hash_and_repr_stay_out():
    _, P = _pair(dict(frozen=True), _plain)
    assert P(1, skip=1) == P(1, skip=2)                 # compare=False
    assert P(1, nohash=1) != P(1, nohash=2)             # hash=False still compares
    assert hash(P(1, nohash=1)) == hash(P(1, nohash=2))
    assert hash(P(1, onlyhash=1)) != hash(P(1, onlyhash=2)) and P(1, onlyhash=1) == P(1, onlyhash=2)
    assert "quiet" not in repr(P(1)) and "skip=0" in repr(P(1))


def test_frozen_stays_frozen_and_replace_and_asdict_work():
    @datatypes.dataclass(frozen=True)
    class F:
        a: int
        b: list = field(default_factory=list)
    f = F(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.a = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        del f.a
    assert dataclasses.replace(f, a=3) == F(3) and dataclasses.asdict(F(1, [2])) == {"a": 1, "b": [2]}


def test_a_subclass_compares_its_own_fields_and_a_class_keeps_its_own_methods():
    @datatypes.dataclass(frozen=True)
    class Base:
        a: int

    @datatypes.dataclass(frozen=True)
    class Child(Base):
        b: int = 0

    assert Child(1, 2) != Child(1, 3) and Child(1, 2) == Child(1, 2) and Base(1) != Child(1)
    assert repr(Child(1, 2)) == ("test_a_subclass_compares_its_own_fields_and_a_class_keeps_its_own_methods."
                                 "<locals>.Child(a=1, b=2)")

    @datatypes.dataclass(frozen=True)
    class Own:
        a: int

        def __eq__(self, other):
            return True

        def __hash__(self):
            return 7

        def __repr__(self):
            return "own"
    assert Own(1) == Own(2) and hash(Own(1)) == 7 and repr(Own(1)) == "own"

    @datatypes.dataclass(frozen=True)
    class EqOnly:            # its own __eq__, no __hash__: the standard decorator adds the fields' hash
        a: int

        def __eq__(self, other):
            return True
    std = dataclasses.dataclass(frozen=True)(type("EqOnly", (), {"__annotations__": {"a": "int"},
                                                                "__eq__": lambda s, o: True}))
    assert hash(EqOnly(4)) == hash(std(4))


def test_a_recursive_value_prints_as_the_standard_one_does():
    std, ours = _pair({}, _one)
    s, o = std([]), ours([])
    s.only.append(s)
    o.only.append(o)
    assert repr(o).replace(ours.__qualname__, "X") == repr(s).replace(std.__qualname__, "X")


def test_other_keywords_are_the_standard_decorators():
    @datatypes.dataclass(order=True, frozen=True)
    class O:
        a: int
    assert O(1) < O(2) and "__lt__" in O.__dict__


def test_detect_compiles_no_generated_eq_hash_or_repr():
    """Why the module exists: making driverd's classes compiles only __init__ (and the frozen
    __setattr__/__delattr__), not a __eq__, __hash__ or __repr__ for each."""
    if not hasattr(dataclasses, "_create_fn"):
        pytest.skip("this Python compiles a class's generated methods in one go (3.13+): nothing to count")
    code = ("import dataclasses, collections\n"
            "made = collections.Counter()\n"
            "orig = dataclasses._create_fn\n"
            "def count(name, *a, **k):\n"
            "    made[name] += 1\n"
            "    return orig(name, *a, **k)\n"
            "dataclasses._create_fn = count\n"
            "import driverd.host.facts, driverd.config, driverd.cli.context\n"
            "print(made['__init__'], made['__eq__'] + made['__hash__'] + made['__repr__'])\n")
    inits, others = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                            check=True).stdout.split())
    assert inits >= 20 and others == 0, (inits, others)


def _version_tuple(base):
    """The same NamedTuple body on typing's base or on driverd.datatypes'."""
    class Version(base):
        """a docstring"""
        version: str
        flavor: str = ""

        def __str__(self) -> str:
            return f"{self.version} ({self.flavor})"

        @classmethod
        def make(cls, v: str) -> "Version":
            return cls(v)
    return Version


def test_named_tuple_is_typings_without_typing():
    import typing
    Std, Ours = _version_tuple(typing.NamedTuple), _version_tuple(datatypes.NamedTuple)
    s, o = Std("580", "open"), Ours("580", "open")
    assert tuple(s) == tuple(o) and o == ("580", "open") and hash(o) == hash(s)     # tuples, as typing's
    assert repr(o) == repr(s) == "Version(version='580', flavor='open')" and str(o) == str(s) == "580 (open)"
    assert Ours._fields == Std._fields and Ours._field_defaults == Std._field_defaults == {"flavor": ""}
    assert Ours.make("1") == Ours("1", "") and type(Ours.make("1")) is Ours and o._replace(flavor="") == ("580", "")
    assert Ours.__doc__ == "a docstring" and Ours.__annotations__ == {"version": "str", "flavor": "str"}
    assert Ours.__module__ == Std.__module__ == __name__ and Ours.__qualname__ == Std.__qualname__
    assert Ours.__mro__[1:] == Std.__mro__[1:] == (tuple, object) and isinstance(o, tuple)
    with pytest.raises(TypeError):
        class Bad(datatypes.NamedTuple):
            a: int = 1
            b: int
    with pytest.raises(AttributeError):
        class Worse(datatypes.NamedTuple):
            a: int

            def _replace(self):
                return self
    with pytest.raises(TypeError, match="super"):
        class Cell(datatypes.NamedTuple):
            a: int

            def __repr__(self):
                return super().__repr__()
