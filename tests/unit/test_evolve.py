"""processors/evolve.py: a compiled replace gives what dataclasses.replace gives."""
import dataclasses

import pytest

from processors.evolve import evolver
from processors.scheduler.model import Job, Task, Terms, replace

BASE = Task(id="e1.j/3", index=3, state="RUNNING", machine="m1", dc="dc1", msb="msb1", rack="r1",
            terms=Terms(1000, 2048), discovery=True, running_since_ms=1)


@pytest.mark.parametrize("changes", [
    {},
    {"state": "STOPPING"},
    {"machine": None, "dc": None, "msb": None, "rack": None, "terms": None},
    {"op": "MOVE", "op_id": "e1.j/3:move:1", "op_state": "PENDING", "op_reason": "maintenance"},
    {"restarts": 2, "reason": "restart_limit", "parked": True},
])
def test_a_compiled_replace_equals_dataclasses_replace(changes):
    assert BASE.row is BASE._row  # the published row is cached on the object...
    new = evolver(Task)(BASE, changes)
    assert new == dataclasses.replace(BASE, **changes) == replace(BASE, **changes)
    assert new._row is None  # ...and not carried over: a field with init=False gets its default, as with replace
    assert type(new) is Task


def test_an_unknown_field_is_refused_as_by_dataclasses_replace():
    with pytest.raises(TypeError, match="unknown fields"):
        evolver(Task)(BASE, {"nope": 1})
    with pytest.raises(TypeError):
        dataclasses.replace(BASE, nope=1)


def test_other_dataclasses_go_through_dataclasses_replace():
    assert replace(Terms(1, 2), cpu=5) == Terms(5, 2)


@dataclasses.dataclass(frozen=True)
class Plain:
    a: int
    b: tuple = ()
    c: list = dataclasses.field(default_factory=list)
    cache: dict | None = dataclasses.field(default=None, init=False, compare=False)
    made: list = dataclasses.field(default_factory=lambda: ["fresh"], init=False, compare=False)


@pytest.mark.parametrize("changes", [{}, {"a": 2}, {"b": (1,), "c": [3]}])
def test_a_copying_replace_equals_dataclasses_replace(changes):
    """A class with a ``__dict__`` and no ``__post_init__`` is copied, not built again: the same value, a new object,
    ``init=False`` fields at their defaults (a cache is not carried over), the old object unchanged."""
    old = Plain(1, (0,), [1])
    object.__setattr__(old, "cache", {"x": 1})
    new = evolver(Plain)(old, changes)
    want = dataclasses.replace(old, **changes)
    assert new == want and new is not old and type(new) is Plain
    assert (new.cache, new.made) == (want.cache, want.made) == (None, ["fresh"])
    assert old == Plain(1, (0,), [1]) and old.cache == {"x": 1}
    assert vars(new) == vars(want)


def test_a_job_is_copied_and_equals_dataclasses_replace():
    job = Job(id="e1.j", entitlement="e1", spec=None, spec_version=1, desired=3, seen=("a",))
    assert replace(job, desired=4, seen=("a", "b")) == dataclasses.replace(job, desired=4, seen=("a", "b"))
    with pytest.raises(TypeError, match="unknown fields"):
        replace(job, nope=1)


def test_a_class_with_post_init_is_built_again():
    @dataclasses.dataclass(frozen=True)
    class Checked:
        a: int

        def __post_init__(self):
            if self.a < 0:
                raise ValueError("negative")

    with pytest.raises(ValueError):
        evolver(Checked)(Checked(1), {"a": -1})
