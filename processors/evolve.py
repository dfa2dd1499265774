"""``dataclasses.replace`` made cheap for a dataclass on a hot path. Pure.

``dataclasses.replace`` walks the class's fields on every call (checks, a kwargs dict, then ``__init__``): ~6 µs for
the scheduler's ``Task`` of 26 fields, and a decision replaces a task several times (186 calls per 36-task job in a
burst: the largest share of the scheduler's own time in a cProfile). ``evolver(cls)`` compiles, once, a function
that calls ``cls(...)`` with each field taken from the changes or the object: the same result (``__init__`` runs,
so fields with ``init=False`` get their defaults, as with ``replace``), about half the time.

A dataclass with a ``__dict__`` (no ``slots``) and no ``__post_init__`` takes a shorter way: the new object gets a
copy of the old one's ``__dict__`` with the changes over it (and each ``init=False`` field's default), without calling
``__init__``, which for a frozen class sets every field through ``object.__setattr__``: the scheduler's ``Job`` of 34
fields, replaced each time a decision sets one (18 % of a shard's CPU in a burst, py-spy, stop 41), 9.0 → 1.0 µs;
its ``Task`` too since stop 42 (slots dropped for it: a decided job's life 1.83 → 1.26 ms, ``bench/decide_cost.py``).
The result is the same: ``__init__`` of such a class only assigns its fields.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def evolver(cls: type[T]) -> Callable[[T, Mapping[str, Any]], T]:
    """``f(obj, changes)`` == ``dataclasses.replace(obj, **changes)`` for instances of ``cls`` (a dataclass whose
    ``init`` fields are all keyword-passable; none may be an ``InitVar``). Unknown names raise TypeError."""
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    known = frozenset(names)
    if "__dict__" in dir(cls) and not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__"):
        return _copying(cls, known)
    args = ", ".join(f"{n}=changes[{n!r}] if {n!r} in changes else obj.{n}" for n in names)
    namespace: dict[str, Any] = {"_cls": cls, "_known": known}
    exec(f"def evolve(obj, changes):\n"  # noqa: S102 - generated from the class's own field names only
         f"    if not changes.keys() <= _known:\n"
         f"        raise TypeError(f'{cls.__name__}: unknown fields {{sorted(changes.keys() - _known)}}')\n"
         f"    return _cls({args})\n", namespace)
    return namespace["evolve"]


def _copying(cls: type[T], known: frozenset[str]) -> Callable[[T, Mapping[str, Any]], T]:
    """``evolver`` for a class whose ``__init__`` only assigns its fields: a copy of the object's ``__dict__``."""
    defaults = {f.name: f for f in dataclasses.fields(cls) if not f.init}
    new, set_attr = object.__new__, object.__setattr__

    def evolve(obj: T, changes: Mapping[str, Any]) -> T:
        if not changes.keys() <= known:
            raise TypeError(f"{cls.__name__}: unknown fields {sorted(changes.keys() - known)}")
        values = obj.__dict__.copy()
        values.update(changes)
        for name, f in defaults.items():  # as ``__init__`` would: the default, not the old object's value
            if f.default_factory is not dataclasses.MISSING:
                values[name] = f.default_factory()
            else:  # ``__init__`` leaves it to the class attribute
                values.pop(name, None)
        made = new(cls)
        set_attr(made, "__dict__", values)
        return made
    return evolve
