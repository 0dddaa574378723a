"""`dataclass`: the standard library's, with shared methods instead of ones compiled for each class;
`NamedTuple`: typing's, without importing typing.

Why (issue 47): Python 3.12 compiles each method `dataclasses` generates with its own `exec`, six for a
frozen class (`__init__`, `__repr__`, `__eq__`, `__setattr__`, `__delattr__`, `__hash__`), ~80 us each on
a slow host. `detect` makes about forty of these classes before it reads anything; on a GPU host that was
the largest part of its own start-up (driverd.host.facts alone: 24 ms of import there). Here nothing is
compiled: `__eq__`, `__hash__` and `__repr__` are one function for every class, reading the field names
the class keeps from when it was made; `__init__` and the frozen class's `__setattr__` and `__delattr__`
are closures over the class and its fields (making a function from existing code compiles nothing). They
compare, hash, print, set, refuse and complain as the generated ones do (compare=False, hash=...,
repr=False, defaults and default factories, __post_init__ included); the class is still a dataclass to
`dataclasses.fields`, `asdict`, `replace` and `is_dataclass`. A closure binds its arguments in Python, ~1 us
a call more than compiled code, so a class made HOT_AFTER times (NodeView, at every admission) gets the
standard decorator's compiled `__init__` then: compiling is paid only where it pays back.

Anything this does not cover (order=True, slots=True, kw_only, InitVar, a class without a docstring, one
with dataclass bases, ...) is handed to the standard decorator, which then makes what it makes.

`typing` costs 8-12 ms of a command's start on a GPU host on top of what else detect imports; driverd's
modules on detect's path import it only for type checkers, and take `NamedTuple` from here: to a type
checker it is typing's, at run time a base that makes the class a collections.namedtuple as typing's
does. A host with a TOML config (containerd's, CRI-O's, driverd's) still imports typing, through tomllib;
a bare host does not.
"""
from __future__ import annotations

import collections
import reprlib
from operator import attrgetter, itemgetter

_SHARED = {"frozen"}        # the only keyword the shared methods are written for


def _getter(names: tuple[str, ...], get=attrgetter):
    """The values of `names` of an instance (or, with get=itemgetter, of a dict), as a tuple (attrgetter
    and itemgetter give a bare value for one name)."""
    if len(names) > 1:
        return get(*names)
    if names:
        one = get(names[0])
        return lambda o: (one(o),)
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
    wants_eq, wants_repr, wants_init = "__eq__" not in own, "__repr__" not in own, "__init__" not in own
    if not _closures_fit(cls):
        cls = dataclasses.dataclass(cls, frozen=frozen, eq=False, repr=False)
    else:
        if frozen:
            for name in ("__setattr__", "__delattr__"):
                if name in own:         # the standard decorator's refusal, in its words
                    raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
        # frozen=False and init=False: the standard decorator compiles nothing; what they would have
        # made is put on below, and its parameters then say what the class is
        cls = dataclasses.dataclass(cls, init=False, eq=False, repr=False)
        params = cls.__dataclass_params__
        params.init, params.frozen = True, frozen
        fields = dataclasses.fields(cls)
        if wants_init:
            cls.__init__ = _init_for(cls, fields, frozen)
        if frozen:
            cls.__setattr__, cls.__delattr__ = _frozen_for(cls, fields)
    params = cls.__dataclass_params__
    params.eq, params.repr = True, True     # they compare and print as eq=True, repr=True makes them do
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


def _closures_fit(cls: type) -> bool:
    """Whether the closures below make all the class needs: not where a dataclass base's checks and
    fields come in, nor for fields they are not written for (InitVar, KW_ONLY, kw_only=True), nor for a
    class without a docstring (the standard decorator writes one from its __init__'s signature)."""
    import dataclasses
    if not cls.__dict__.get("__doc__") or any(hasattr(b, "__dataclass_fields__") for b in cls.__mro__[1:]):
        return False
    for name, kind in cls.__dict__.get("__annotations__", {}).items():
        if kind is dataclasses.KW_ONLY or isinstance(kind, dataclasses.InitVar) or kind is dataclasses.InitVar:
            return False
        if isinstance(kind, str) and ("InitVar" in kind or "KW_ONLY" in kind):
            return False
        value = cls.__dict__.get(name)
        if isinstance(value, dataclasses.Field) and value.kw_only is True:
            return False
    return True


_UNSET = object()
_REQUIRED, _VALUE, _FACTORY = 0, 1, 2
# A class made this many times gets the standard decorator's compiled __init__ in place of the closure:
# compiling costs ~0.1-0.4 ms once, the closure ~1 us more a call than the compiled code (a NodeView,
# made for every node at each admission), so compiling pays only for the classes that are made often.
HOT_AFTER = 256


def _init_for(cls: type, fields: tuple, frozen: bool):
    """The __init__ the standard decorator would compile: the init fields as parameters in order, each
    default or default factory, an init=False field's factory, __post_init__; values set with
    object.__setattr__ on a frozen class, with setattr otherwise. Made HOT_AFTER times, the class gets the
    compiled one."""
    from dataclasses import MISSING
    names, fill, plan = [], [], []       # plan: each field set, in order, from a parameter or a factory
    for f in fields:
        if f.default_factory is not MISSING:
            how = (_FACTORY, f.default_factory)
        elif f.default is not MISSING:
            how = (_VALUE, f.default)
        else:
            how = (_REQUIRED, None)
        if f.init:
            if how[0] == _REQUIRED and fill and fill[-1][0] != _REQUIRED:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
            plan.append((f.name, len(names), None))
            names.append(f.name)
            fill.append(how)
        elif how[0] == _FACTORY:
            plan.append((f.name, None, f.default_factory))
    names, fill = tuple(names), tuple(fill)
    # an init=False field with a factory is set among the others, in field order, as the compiled one does
    mixed = tuple(plan) if len(plan) > len(names) else None
    if mixed is not None:
        names_set = tuple(name for name, _, _ in mixed)
    index = {name: i for i, name in enumerate(names)}
    count = len(names)
    required = sum(1 for kind, _ in fill if kind == _REQUIRED)
    put = object.__setattr__ if frozen else setattr
    post = hasattr(cls, "__post_init__")
    where = f"{cls.__qualname__}.__init__()"

    def bind(args: tuple, kw: dict) -> list:
        """The values of every parameter, as Python binds a call to the compiled __init__."""
        if len(args) > count:
            takes = f"from {required + 1} to {count + 1}" if required < count else f"{count + 1}"
            raise TypeError(f"{where} takes {takes} positional argument{_s(count + 1)} but "
                            f"{len(args) + 1} were given")
        values = list(args) + [_UNSET] * (count - len(args))
        for key, value in kw.items():
            i = index.get(key)
            if i is None:
                raise TypeError(f"{where} got an unexpected keyword argument {key!r}")
            if values[i] is not _UNSET:
                raise TypeError(f"{where} got multiple values for argument {key!r}")
            values[i] = value
        missing = []
        for i, value in enumerate(values):
            if value is _UNSET:
                kind, default = fill[i]
                if kind == _VALUE:
                    values[i] = default
                elif kind == _FACTORY:
                    values[i] = default()
                else:
                    missing.append(repr(names[i]))
        if missing:
            listed = missing[0] if len(missing) == 1 else (
                " and ".join(missing) if len(missing) == 2 else ", ".join(missing[:-1]) + ", and " + missing[-1])
            raise TypeError(f"{where} missing {len(missing)} required positional argument{_s(len(missing))}: "
                            f"{listed}")
        return values

    defaults = {name: default for name, (kind, default) in zip(names, fill) if kind == _VALUE}
    factories = tuple((name, default) for name, (kind, default) in zip(names, fill) if kind == _FACTORY)
    pick = _getter(names, itemgetter)

    calls = 0

    def __init__(self, /, *args, **kw):
        nonlocal calls
        if args:
            values = args if len(args) == count and not kw else bind(args, kw)
        else:
            # by keywords (most calls): the defaults and the given merged at C speed; what does not fit
            # (a name unknown or missing) is bound again, for the error Python would give
            given = {**defaults, **kw}
            for name, factory in factories:
                if name not in given:
                    given[name] = factory()
            try:
                values = pick(given) if len(given) == count else bind((), kw)
            except KeyError:
                values = bind((), kw)
        if mixed is None:
            setting = zip(names, values)
        else:
            setting = zip(names_set, [values[i] if i is not None else factory() for _, i, factory in mixed])
        for name, value in setting:
            put(self, name, value)
        if post:
            self.__post_init__()
        calls += 1
        # >=: threads may both count past HOT_AFTER; the class's own __init__ is checked, so it switches once
        if calls >= HOT_AFTER and cls.__dict__.get("__init__") is __init__:
            try:
                cls.__init__ = _compiled_init(cls, fields, frozen)
            except Exception:       # the closure stays: a switch that fails must not fail this instance
                calls = -(1 << 62)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    return __init__


def _compiled_init(cls: type, fields: tuple, frozen: bool):
    """The standard decorator's compiled __init__ for `cls`, made on a stand-in class with the same fields
    (and a __post_init__ where `cls` has one: the compiled code calls it on the instance)."""
    import dataclasses
    ns = {"__annotations__": {f.name: f.type for f in fields}, "__module__": cls.__module__,
          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    for f in fields:
        ns[f.name] = dataclasses.field(default=f.default, default_factory=f.default_factory, init=f.init,
                                       repr=f.repr, hash=f.hash, compare=f.compare, metadata=f.metadata)
    if hasattr(cls, "__post_init__"):
        ns["__post_init__"] = cls.__post_init__
    return dataclasses.dataclass(type(cls.__name__, (), ns), frozen=frozen, eq=False, repr=False).__init__


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _frozen_for(cls: type, fields: tuple):
    """The frozen class's __setattr__ and __delattr__, as the standard decorator compiles them: a field,
    or anything on the class itself, cannot be set or deleted; a subclass's own attributes can."""
    from dataclasses import FrozenInstanceError
    names = frozenset(f.name for f in fields)

    def __setattr__(self, name, value):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        super(cls, self).__setattr__(name, value)

    def __delattr__(self, name):
        if type(self) is cls or name in names:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        super(cls, self).__delattr__(name)

    for method in (__setattr__, __delattr__):
        method.__qualname__ = f"{cls.__qualname__}.{method.__name__}"
    return __setattr__, __delattr__


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
