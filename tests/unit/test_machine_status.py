"""Table-driven tests of a machine's status lifecycle (``processors/resourcebroker/status.py``): the one table both
the Resource Broker and the Health Check Service decide a status change by."""
import pytest

from processors.health import decide as health
from processors.resourcebroker import decide as broker
from processors.resourcebroker.status import (
    DOWN, FAILED, HEALTH_JUDGED, HEALTH_TRIGGERS, HEARD, MAINTENANCE, MAINTENANCE_ENDED, MAINTENANCE_STARTED,
    NO_CHANGE, RECOVERED, SILENT, STATUS_TRANSITIONS, TRIGGERS, UNHEALTHY, UNKNOWN, UP, IllegalStatusTransition,
    moves, next_status,
)

LEGAL = [(UP, FAILED, DOWN), (UNHEALTHY, FAILED, DOWN), (MAINTENANCE, FAILED, DOWN), (DOWN, RECOVERED, UP),
         (UP, MAINTENANCE_STARTED, MAINTENANCE), (UNHEALTHY, MAINTENANCE_STARTED, MAINTENANCE),
         (MAINTENANCE, MAINTENANCE_ENDED, UP),
         (UP, SILENT, UNHEALTHY), (UNHEALTHY, HEARD, UP)]
UNCHANGED = [(DOWN, FAILED), (UP, RECOVERED), (MAINTENANCE, MAINTENANCE_STARTED), (DOWN, MAINTENANCE_STARTED),
             (UP, MAINTENANCE_ENDED), (DOWN, MAINTENANCE_ENDED), (UNHEALTHY, MAINTENANCE_ENDED),
             (UNHEALTHY, SILENT), (UP, HEARD)]
ILLEGAL = [(UNHEALTHY, RECOVERED), (MAINTENANCE, RECOVERED), (UNKNOWN, FAILED), (UNKNOWN, RECOVERED),
           (DOWN, SILENT), (MAINTENANCE, SILENT), (DOWN, HEARD), (MAINTENANCE, HEARD), (UNKNOWN, SILENT),
           (UNKNOWN, HEARD)]


@pytest.mark.parametrize("status, trigger, target", LEGAL)
def test_legal_transitions(status, trigger, target):
    assert next_status("m", status, trigger) == target
    assert moves(status, trigger)


@pytest.mark.parametrize("status, trigger", UNCHANGED)
def test_no_change_transitions(status, trigger):
    assert next_status("m", status, trigger) is None
    assert not moves(status, trigger)


@pytest.mark.parametrize("status, trigger", ILLEGAL)
def test_illegal_transitions_raise(status, trigger):
    with pytest.raises(IllegalStatusTransition, match=f"machine m: '{trigger}' is illegal in status {status}"):
        next_status("m", status, trigger)
    assert not moves(status, trigger)


def test_tables_are_complete_and_disjoint():
    assert set(STATUS_TRANSITIONS) == {(s, t) for s, t, _ in LEGAL}
    assert NO_CHANGE == set(UNCHANGED)
    assert not set(STATUS_TRANSITIONS) & NO_CHANGE
    assert {t for _, t in STATUS_TRANSITIONS} == set(TRIGGERS)
    assert not any(s == UNKNOWN for s, _ in STATUS_TRANSITIONS)  # no transition leaves UNKNOWN


@pytest.mark.parametrize("status, trigger, legal", [
    (UNHEALTHY, RECOVERED, "failed, maintenance_started"),  # an operator is told the broker's triggers only
    (DOWN, SILENT, "none"),  # the health check its own
    (MAINTENANCE, HEARD, "none"),
    (UNKNOWN, FAILED, "none"),
])
def test_illegal_names_the_deciders_legal_triggers(status, trigger, legal):
    with pytest.raises(IllegalStatusTransition, match=f"legal there: {legal}$"):
        next_status("m", status, trigger)


def test_one_table_for_both_deciders():
    """The broker's and the health check's names are the table's, not copies."""
    assert broker.STATUS_TRANSITIONS is STATUS_TRANSITIONS and broker.next_status is next_status
    assert broker.IllegalStatusTransition is IllegalStatusTransition
    assert HEALTH_JUDGED == {UP, UNHEALTHY} and health.JUDGED is HEALTH_JUDGED
    assert HEALTH_TRIGGERS == {SILENT, HEARD}
