"""`dataclass`: the standard library's, with one shared `__eq__`, `__hash__` and `__repr__` for every
class instead of three generated for each; `NamedTuple`: typing's, without importing typing.

Why (issue 47): Python 3.12 compiles each method `dataclasses` generates with its own `exec`, six for a
frozen class (`__init__`, `__repr__`, `__eq__`, `__setattr__`, `__delattr__`, `__hash__`). `detect` makes
about forty of these classes before it reads anything; on a GPU host that was the largest part of its
own start-up (driverd.host.facts alone: 24 ms of import there). The shared methods read each class's
field names once, when it is made, so they compare, hash and print exactly as the generated ones do
(fields with compare=False, hash=..., repr=False included); `__init__` and the frozen class's
`__setattr__` and `__delattr__` are still the standard library's.

Anything this does not cover (order=True, slots=True, ...) is handed to the standard decorator as is.

`typing` costs 8-12 ms of a command's start on a GPU host on top of what else detect imports; driverd's
modules on detect's path import it only for type checkers, and take `NamedTuple` from here: to a type
checker it is typing's, at run time a base that makes the class a collections.namedtuple as typing's
does. A host with a TOML config (containerd's, CRI-O's, driverd's) still imports typing, through tomllib;
a bare host does not.
"""
from __future__ import annotations

import collections
import reprlib
from operator import attrgetter

_SHARED = {"frozen"}        # the only keyword the shared methods are written for


def _getter(names: tuple[str, ...]):
    """The values of `names` of an instance, as a tuple (attrgetter gives a bare value for one name)."""
    if len(names) > 1:
        return attrgetter(*names)
    if names:
        one = names[0]
        return lambda o: (getattr(o, one),)
    return lambda o: ()


def _eq(self, other):
    if other.__class__ is self.__class__:
        key = type(self)._dt_compare
        return key(self) == key(other)
    return NotImplemented


def _hash(self):
    return hash(type(self)._dt_hash(self))


@reprlib.recursive_repr()
def _repr(self):
    cls = type(self)
    return f"{cls.__qualname__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in cls._dt_repr) + ")"


def _shared(cls: type, frozen: bool) -> type:
    import dataclasses
    own = cls.__dict__
    class_hash = own.get("__hash__", dataclasses.MISSING)
    explicit_hash = not (class_hash is dataclasses.MISSING or (class_hash is None and "__eq__" in own))
    wants_eq, wants_repr = "__eq__" not in own, "__repr__" not in own
    cls = dataclasses.dataclass(cls, frozen=frozen, eq=False, repr=False)
    fields = dataclasses.fields(cls)
    cls._dt_compare = _getter(tuple(f.name for f in fields if f.compare))
    cls._dt_hash = _getter(tuple(f.name for f in fields if (f.compare if f.hash is None else f.hash)))
    cls._dt_repr = tuple(f.name for f in fields if f.repr)
    if wants_eq:
        cls.__eq__ = _eq
    if wants_repr:
        cls.__repr__ = _repr
    if not explicit_hash:
        # as the standard decorator's table for eq=True: frozen gets a hash of its compared fields,
        # mutable gets none (unhashable)
        cls.__hash__ = _hash if frozen else None
    return cls


def dataclass(cls: type | None = None, /, **kw):
    """`dataclasses.dataclass`, with the shared methods where the keywords are only `frozen`."""
    # dataclasses (with inspect, ast, dis: ~9 ms on a GPU host) is imported by the first class made, not
    # by a module that only takes NamedTuple from here (driver/ident.py, which detect reads first)
    import dataclasses
    if set(kw) - _SHARED:
        return dataclasses.dataclass(cls, **kw) if cls is not None else dataclasses.dataclass(**kw)
    frozen = bool(kw.get("frozen", False))
    if cls is None:
        return lambda c: _shared(c, frozen)
    return _shared(cls, frozen)


# what a NamedTuple's body may not define (typing's own list: they are the tuple's)
_TUPLE_OWN = frozenset({"__new__", "__init__", "__slots__", "__getnewargs__", "_fields", "_field_defaults",
                        "_make", "_replace", "_asdict", "_source"})
_NOT_COPIED = frozenset({"__module__", "__annotations__", "__qualname__"})


class _NamedTupleMeta(type):
    """`class X(NamedTuple)`: the annotated names are the fields, in order, a value being the field's
    default; everything else in the body (methods, the docstring) goes onto the collections.namedtuple
    made, as typing's NamedTupleMeta puts it there."""

    def __new__(mcls, name: str, bases: tuple, ns: dict):
        if ns.get("_base_of_named_tuples"):
            return super().__new__(mcls, name, bases, ns)
        annotations = ns.get("__annotations__", {})
        names = list(annotations)
        defaults = [ns[n] for n in names if n in ns]
        if any(n not in ns for n in names[len(names) - len(defaults):]):
            raise TypeError(f"{name}: a field without a default follows one with a default")
        bad = _TUPLE_OWN & set(ns)
        if bad:
            raise AttributeError(f"{name}: cannot define {', '.join(sorted(bad))} in a NamedTuple")
        if "__classcell__" in ns:       # the class made is not the one the body's cell would name
            raise TypeError(f"{name}: a NamedTuple's methods cannot use super() or __class__")
        made = collections.namedtuple(name, names, defaults=defaults, module=ns.get("__module__"))
        made.__qualname__ = ns.get("__qualname__", name)
        made.__annotations__ = annotations
        for key, value in ns.items():
            if key not in names and key not in _NOT_COPIED:
                setattr(made, key, value)
        return made


TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NamedTuple
else:
    class NamedTuple(metaclass=_NamedTupleMeta):
        """The base of `class X(NamedTuple)`: X is made a collections.namedtuple (_NamedTupleMeta)."""
        _base_of_named_tuples = True
