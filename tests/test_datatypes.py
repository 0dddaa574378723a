"""driverd.datatypes.dataclass behaves as the standard library's: the same equality, hash and repr, the
same __init__ (defaults, factories, __post_init__, the same errors), the same frozen errors, the same
fields: its methods are shared or closures instead of compiled for each class."""
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


def test_detect_compiles_no_method_of_its_classes():
    """Why the module exists: making driverd's classes compiles nothing (3.12 compiled six methods for
    each frozen class), and the standard decorator is still what makes them dataclasses."""
    if not hasattr(dataclasses, "_create_fn"):
        pytest.skip("this Python compiles a class's generated methods in one go (3.13+): nothing to count")
    code = ("import dataclasses, collections\n"
            "made = collections.Counter()\n"
            "orig, proc = dataclasses._create_fn, dataclasses._process_class\n"
            "def count(name, *a, **k):\n"
            "    made[name] += 1\n"
            "    return orig(name, *a, **k)\n"
            "def processed(*a, **k):\n"
            "    made['class'] += 1\n"
            "    return proc(*a, **k)\n"
            "dataclasses._create_fn, dataclasses._process_class = count, processed\n"
            "import driverd.host.facts, driverd.config, driverd.cli.context\n"
            "print(made.pop('class'), sum(made.values()))\n")
    classes, compiled = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                check=True).stdout.split())
    assert classes >= 20 and compiled == 0, (classes, compiled)


def _fields_body():
    class F:
        """f"""
        a: int
        b: str = "x"
        c: list = field(default_factory=list)
        d: dict = field(default_factory=dict, init=False)
        e: int = field(default=5, init=False)
        f: tuple = ()
    return F


CALLS = [((1,), {}), ((1, "y", [2], (3,)), {}), ((), {"a": 1}), ((), {"f": (1,), "a": 2, "c": [9]}),
         ((1,), {"b": "z"}), ((1, "y"), {"c": [], "f": ()})]
BAD_CALLS = [((), {}), ((1, 2, 3, 4, 5), {}), ((1,), {"a": 2}), ((1,), {"zz": 2}), ((), {"b": "y"}),
             ((), {"d": {}}), ((), {"a": 1, "zz": 2, "b": "q"})]


def _heat(cls, *args) -> None:
    """Make the class often enough for its __init__ to become the standard decorator's compiled one."""
    closure = cls.__init__
    for _ in range(datatypes.HOT_AFTER):
        cls(*args)
    assert cls.__init__ is not closure and cls.__init__.__code__.co_filename == "<string>"
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"


HEAT = [False, True]


@pytest.mark.parametrize("heated", HEAT, ids=["closure", "compiled"])
@pytest.mark.parametrize("kw", KINDS, ids=["mutable", "frozen"])
def test_init_binds_defaults_factories_and_errors_as_the_compiled_one(kw, heated):
    std, ours = _pair(kw, _fields_body)
    assert "__init__" in ours.__dict__ and ours.__dataclass_params__.init and \
        ours.__dataclass_params__.frozen == std.__dataclass_params__.frozen
    assert ours.__init__.__code__.co_filename != "<string>"        # nothing compiled while it is made
    if heated:
        _heat(ours, 1)
    for args, kwargs in CALLS:
        s, o = std(*args, **kwargs), ours(*args, **kwargs)
        assert list(vars(s).items()) == list(vars(o).items())       # the same values, set in the same order
        assert dataclasses.asdict(s) == dataclasses.asdict(o) and repr(s) == repr(o)
    a, b = ours(1), ours(1)
    assert a.c is not b.c and a.d is not b.d                          # a factory's value per instance
    assert ours.e == 5 and "e" not in vars(a)                         # init=False with a default: the class's
    for args, kwargs in BAD_CALLS:
        with pytest.raises(TypeError) as s_err:
            std(*args, **kwargs)
        with pytest.raises(TypeError) as o_err:
            ours(*args, **kwargs)
        assert str(o_err.value).replace(ours.__qualname__, "X") == str(s_err.value).replace(std.__qualname__, "X")


def test_a_switch_that_fails_leaves_the_closure_and_makes_the_instance(monkeypatch):
    def broken(*a):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(datatypes, "_compiled_init", broken)      # from the test side
    std, ours = _pair(dict(frozen=True), _fields_body)
    closure = ours.__init__
    made = [ours(i) for i in range(datatypes.HOT_AFTER * 2)]
    assert ours.__init__ is closure and made[-1] == ours(datatypes.HOT_AFTER * 2 - 1)
    assert repr(made[7]) == repr(std(7)).replace(std.__qualname__, ours.__qualname__)


@pytest.mark.parametrize("heated", HEAT, ids=["closure", "compiled"])
def test_post_init_runs_and_a_subclass_sets_through_its_own_setattr(heated):
    seen = []

    @datatypes.dataclass
    class P:
        """p"""
        a: int

        def __post_init__(self):
            seen.append(self.a)
            self.b = self.a + 1
    if heated:
        _heat(P, 0)
        seen.clear()
    assert P(3).b == 4 and seen == [3]

    class Loud(P):                     # not a dataclass: its own __setattr__ still sees every field set
        def __setattr__(self, name, value):
            seen.append(name)
            super().__setattr__(name, value)
    assert Loud(5).b == 6 and seen[1:] == ["a", 5, "b"]

    @datatypes.dataclass(frozen=True)
    class F:
        """f"""
        a: int

    class Free(F):
        pass
    if heated:
        _heat(F, 0)
    free = Free(1)
    free.other = 2                      # a subclass's own attribute may be set; a field still may not
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'a'"):
        free.a = 3
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'a'"):
        del F(1).a


@pytest.mark.parametrize("heated", HEAT, ids=["closure", "compiled"])
@pytest.mark.parametrize("kw", KINDS, ids=["mutable", "frozen"])
def test_a_fields_descriptor_on_a_base_is_set_through(kw, heated):
    class Doubling:
        """A base (not a dataclass) whose property has a field's name."""
        a = property(lambda self: self._a, lambda self, v: object.__setattr__(self, "_a", v * 2))

    def body():
        class D(Doubling):
            """d"""
            a: int
            b: list = field(default_factory=list, init=False)
        return D
    std, ours = _pair(kw, body)
    if heated:
        _heat(ours, 1)
    assert ours(2).a == std(2).a == 4 and list(vars(ours(2))) == list(vars(std(2))) == ["_a", "b"]


def test_what_the_closures_are_not_written_for_is_the_standard_decorators():
    @datatypes.dataclass(frozen=True)
    class Init:
        """i"""
        a: int
        scale: dataclasses.InitVar[int] = 1

        def __post_init__(self, scale):
            object.__setattr__(self, "a", self.a * scale)
    assert Init(2, 3).a == 6

    @datatypes.dataclass
    class Kw:
        """k"""
        a: int
        b: int = field(default=0, kw_only=True)
    assert Kw(1, b=2).b == 2
    with pytest.raises(TypeError):
        Kw(1, 2)

    @datatypes.dataclass
    class NoDoc:
        a: int
    assert NoDoc.__doc__ == dataclasses.dataclass(type("NoDoc", (), {"__annotations__": {"a": "int"}})).__doc__

    with pytest.raises(TypeError, match="non-default argument 'b' follows default argument"):
        @datatypes.dataclass
        class Order:
            """o"""
            a: int = 0
            b: int
    with pytest.raises(TypeError, match="Cannot overwrite attribute __setattr__"):
        @datatypes.dataclass(frozen=True)
        class Own:
            """o"""
            a: int

            def __setattr__(self, name, value):
                pass
    with pytest.raises(TypeError, match="cannot inherit non-frozen dataclass from a frozen one"):
        @datatypes.dataclass(frozen=True)
        class Base:
            """b"""
            a: int

        @datatypes.dataclass
        class Thaw(Base):
            """t"""
            b: int = 0


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
