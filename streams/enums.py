"""The symbols of the schemas' Avro enums, defined once for the Python side (``schemas/*.avsc`` is the source;
``tests/unit/test_enums.py`` checks every class here against it, symbol for symbol and in order).

Values are plain strings, as decoded events carry them; modules that decide on them take their constants from here
(``UP = MachineStatus.UP``) rather than writing ``"UP"`` again. ``symbols(cls)`` is the enum's symbols in the
schema's order."""
from __future__ import annotations


class MachineStatus:  # schemas/MachineStatusChanged.avsc
    UP = "UP"
    UNHEALTHY = "UNHEALTHY"
    DOWN = "DOWN"
    MAINTENANCE = "MAINTENANCE"
    UNKNOWN = "UNKNOWN"  # a reader's fallback for a newer symbol


class TaskCommand:  # schemas/TaskCommanded.avsc
    START = "START"
    STOP = "STOP"
    RESTART = "RESTART"


class TaskState:  # schemas/TaskStateChanged.avsc
    PENDING = "PENDING"
    ALLOCATED = "ALLOCATED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    UNKNOWN = "UNKNOWN"  # previous_state of a task never seen (an agent's, a reader's fallback)


class MaintenanceChoiceKind:  # schemas/TaskControlAcked.avsc
    MOVE = "MOVE"
    STOP = "STOP"
    KEEP = "KEEP"
    OTHER = "OTHER"


class UnavailabilityKind:  # schemas/UnavailabilityStarted.avsc
    FAILURE = "FAILURE"
    MAINTENANCE = "MAINTENANCE"
    POWER = "POWER"
    OTHER = "OTHER"


class OperationKind:  # schemas/TaskControlRequested.avsc
    UPDATE = "UPDATE"
    MOVE = "MOVE"
    RESTART = "RESTART"
    STOP = "STOP"
    OTHER = "OTHER"


class ZoneState:  # schemas/ZoneDisruptionChanged.avsc
    NORMAL = "NORMAL"
    PARTIAL_DISRUPTION = "PARTIAL_DISRUPTION"
    FULL_DISRUPTION = "FULL_DISRUPTION"
    UNKNOWN = "UNKNOWN"  # a reader's fallback for a newer symbol


ENUMS = (MachineStatus, TaskCommand, TaskState, MaintenanceChoiceKind, UnavailabilityKind, OperationKind, ZoneState)


def symbols(cls: type) -> tuple[str, ...]:
    """The enum's symbols in declaration (= schema) order."""
    return tuple(v for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, str))
