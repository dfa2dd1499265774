"""A machine's status: its lifecycle, one table. Pure: no I/O.

Every change of a machine's status is decided here, whoever decides it: the Resource Broker (failures,
recoveries, maintenance, power) and the Health Check Service (silence and its end). ``STATUS_TRANSITIONS`` says
which status a trigger leads to from which; ``NO_CHANGE`` lists the (status, trigger) that change nothing and emit
nothing (a repeated decision, or one already overtaken); anything else is illegal (``next_status`` raises
IllegalStatusTransition). UNKNOWN is only a reader's fallback for a newer symbol: no transition leaves it.

    UP|UNHEALTHY|MAINTENANCE --failed--> DOWN            DOWN --recovered--> UP
    UP|UNHEALTHY --maintenance_started--> MAINTENANCE    MAINTENANCE --maintenance_ended--> UP
    UP --silent--> UNHEALTHY (the health check: no heartbeat for longer than its timeout)
    UNHEALTHY --heard--> UP (the health check: a heartbeat newer than that verdict)
"""
from __future__ import annotations

from types import MappingProxyType

from streams.enums import MachineStatus

# Machine statuses: the MachineStatus symbols of schemas/MachineStatusChanged.avsc.
UP = MachineStatus.UP
UNHEALTHY = MachineStatus.UNHEALTHY
DOWN = MachineStatus.DOWN
MAINTENANCE = MachineStatus.MAINTENANCE
UNKNOWN = MachineStatus.UNKNOWN  # a reader's fallback for a newer symbol; no transition leaves it

# Triggers of status transitions: the Resource Broker's ...
FAILED = "failed"
RECOVERED = "recovered"
MAINTENANCE_STARTED = "maintenance_started"
MAINTENANCE_ENDED = "maintenance_ended"
# ... and the Health Check Service's.
SILENT = "silent"  # no heartbeat for longer than the timeout
HEARD = "heard"  # a heartbeat newer than the silence verdict
TRIGGERS = (FAILED, RECOVERED, MAINTENANCE_STARTED, MAINTENANCE_ENDED, SILENT, HEARD)
HEALTH_TRIGGERS = frozenset({SILENT, HEARD})  # the health check's; the rest are the broker's

STATUS_TRANSITIONS = MappingProxyType({
    (UP, FAILED): DOWN,
    (UNHEALTHY, FAILED): DOWN,
    (MAINTENANCE, FAILED): DOWN,  # broke during maintenance: its failure outlasts the window
    (DOWN, RECOVERED): UP,
    (UP, MAINTENANCE_STARTED): MAINTENANCE,
    (UNHEALTHY, MAINTENANCE_STARTED): MAINTENANCE,
    (MAINTENANCE, MAINTENANCE_ENDED): UP,
    (UP, SILENT): UNHEALTHY,
    (UNHEALTHY, HEARD): UP,
})

# (status, trigger) that change nothing and emit nothing: a repeated decision, or one already overtaken.
NO_CHANGE = frozenset({
    (DOWN, FAILED),
    (UP, RECOVERED),
    (MAINTENANCE, MAINTENANCE_STARTED),
    (DOWN, MAINTENANCE_STARTED),  # already unavailable; stays DOWN until recovered
    (UP, MAINTENANCE_ENDED),
    (DOWN, MAINTENANCE_ENDED),  # failed during the window; stays DOWN until recovered
    (UNHEALTHY, MAINTENANCE_ENDED),
    (UNHEALTHY, SILENT),  # judged silent already: once per silence
    (UP, HEARD),  # a heartbeat of a machine UP: only when it was last heard changes
})

# The statuses the health check moves between (UP, UNHEALTHY); DOWN and MAINTENANCE are the broker's.
HEALTH_JUDGED = frozenset(s for (s, t), to in STATUS_TRANSITIONS.items() if t in HEALTH_TRIGGERS) | frozenset(
    to for (s, t), to in STATUS_TRANSITIONS.items() if t in HEALTH_TRIGGERS)


class BrokerError(ValueError):
    pass


class IllegalStatusTransition(BrokerError):
    def __init__(self, machine_id: str, status: str, trigger: str):
        self.machine_id, self.status, self.trigger = machine_id, status, trigger
        same = HEALTH_TRIGGERS if trigger in HEALTH_TRIGGERS else frozenset(TRIGGERS) - HEALTH_TRIGGERS
        legal = sorted(t for s, t in STATUS_TRANSITIONS if s == status and t in same)  # the decider's own triggers
        super().__init__(f"machine {machine_id}: {trigger!r} is illegal in status {status}; "
                         f"legal there: {', '.join(legal) or 'none'}")


def next_status(machine_id: str, status: str, trigger: str) -> str | None:
    """The status ``trigger`` leads to; None when it changes nothing (``NO_CHANGE``); raises if illegal."""
    if (status, trigger) in STATUS_TRANSITIONS:
        return STATUS_TRANSITIONS[status, trigger]
    if (status, trigger) in NO_CHANGE:
        return None
    raise IllegalStatusTransition(machine_id, status, trigger)


def moves(status: str, trigger: str) -> bool:
    """Whether ``trigger`` changes a machine in ``status`` (a transition of the table, not a no-change)."""
    return (status, trigger) in STATUS_TRANSITIONS
