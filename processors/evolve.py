"""``dataclasses.replace`` made cheap for a dataclass on a hot path. Pure.

``dataclasses.replace`` walks the class's fields on every call (checks, a kwargs dict, then ``__init__``): ~6 µs for
the scheduler's ``Task`` of 26 fields, and a decision replaces a task several times (186 calls per 36-task job in a
burst: the largest share of the scheduler's own time in a cProfile). ``evolver(cls)`` compiles, once, a function
that calls ``cls(...)`` with each field taken from the changes or the object: the same result (``__init__`` runs,
so fields with ``init=False`` get their defaults, as with ``replace``), about half the time.
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
    args = ", ".join(f"{n}=changes[{n!r}] if {n!r} in changes else obj.{n}" for n in names)
    namespace: dict[str, Any] = {"_cls": cls, "_known": known}
    exec(f"def evolve(obj, changes):\n"  # noqa: S102 - generated from the class's own field names only
         f"    if not changes.keys() <= _known:\n"
         f"        raise TypeError(f'{cls.__name__}: unknown fields {{sorted(changes.keys() - _known)}}')\n"
         f"    return _cls({args})\n", namespace)
    return namespace["evolve"]
