"""processors/evolve.py: a compiled replace gives what dataclasses.replace gives."""
import dataclasses

import pytest

from processors.evolve import evolver
from processors.scheduler.model import Task, Terms, replace

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
