"""The TaskControl protocol (Twine §2.5, Figure 8) as data: requests, acks and their bookkeeping. Pure.

The scheduler asks a job's TaskController, on the ``taskcontrol`` topic (keyed by the job's entitlement, so
co-partitioned with everything else of the job), with ``TaskControlRequested``:

    job_id, controller, sequence        (increases with every request of the job)
    pending_operations                  operations awaiting approval: operation_id, task_id, kind, reason
    completed_operation_ids             approved operations finished since the previous request
    in_flight_operation_ids             approved operations the scheduler is performing (not completed): the
                                        controller's in-flight set is exactly this (null in older requests)
    advance_notices                     planned maintenance ahead: unavailability_id, the tasks still on its
                                        machines awaiting a choice, start, deadline, expected duration
    unhealthy_task_ids                  every task of the job not RUNNING, whatever the cause, or about to stop
                                        (its stop waits for a token of the rate limiter)

and the controller answers ``TaskControlAcked(job_id, sequence, approved_operation_ids, controller,
maintenance_choices)``. A choice answers an advance notice for one task (Twine §2.5): ``MOVE`` it off now,
``STOP`` it now and restart it where it is after the maintenance, or ``KEEP`` it running through it (a short
top-of-rack maintenance); a task with no choice is stopped at the notice's deadline. ``decide`` returns the
approved ids, or an ``Answer(approved, choices)``; ``answer_of`` reads either. Only the
ack of the job's latest request, while it is unanswered, counts (``ack_refusal``): an older sequence is stale,
a second ack of the same one a duplicate, a newer one bogus. Operation ids are stable across re-asks.

The controller side keeps, per job, what it approved and has not yet seen completed (``JobBook``, folded by
``observe`` and ``record_ack``), so that ``decide(request, view)`` can count operations in flight.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from streams.enums import MaintenanceChoiceKind, OperationKind

# Operation kinds: the OperationKind symbols of schemas/TaskControlRequested.avsc.
OP_UPDATE = OperationKind.UPDATE  # stop the task to start it again at the job's new spec version (rolling update)
OP_MOVE = OperationKind.MOVE  # place the task elsewhere (its machine was lost)
OP_RESTART = OperationKind.RESTART  # start it again where it is (restart policy): rate limited, never asked
OP_STOP = OperationKind.STOP  # stop it (shrink, job stop, a controller's maintenance MOVE/STOP choice): rate limited, never asked
CONTROLLED = frozenset({OP_UPDATE, OP_MOVE})  # kinds a job's TaskController approves

# A controller's choice for a task under an advance notice: the MaintenanceChoiceKind symbols of
# schemas/TaskControlAcked.avsc.
CHOICE_MOVE = MaintenanceChoiceKind.MOVE  # move it off the machine now
CHOICE_STOP = MaintenanceChoiceKind.STOP  # stop it now; started again where it is when the maintenance ends
CHOICE_KEEP = MaintenanceChoiceKind.KEEP  # leave it running through the maintenance (short top-of-rack maintenance)
CHOICES = frozenset({CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP})

# Why an ack is ignored (the job's last_ignored).
REASON_STALE_ACK = "stale_ack"  # answers an older request than the job's latest
REASON_DUPLICATE_ACK = "duplicate_ack"  # the latest request was answered already
REASON_UNKNOWN_SEQUENCE = "unknown_sequence"  # answers a request never sent
REASON_NO_CONTROLLER = "no_controller"  # the job declares no TaskController
REASON_WRONG_CONTROLLER = "wrong_controller"  # signed by another controller than the job's
REASON_RECOVERED_SINCE_ASKED = "recovered_since_asked"  # approved while the request said the task was down; it
#                                                        serves again, so the approval rests on a stale picture


@dataclass(frozen=True, slots=True)
class Operation:
    operation_id: str
    task_id: str
    kind: str
    reason: str = ""


@dataclass(frozen=True, slots=True)
class AdvanceNotice:
    unavailability_id: str
    task_ids: tuple[str, ...]
    start_ms: int
    deadline_ms: int | None = None
    expected_duration_ms: int | None = None  # how long the machines will be out (None: not said)


@dataclass(frozen=True, slots=True)
class Choice:
    """What a controller chose for ``task_id`` under the advance notice of ``unavailability_id``."""

    unavailability_id: str
    task_id: str
    choice: str  # CHOICE_MOVE, CHOICE_STOP, CHOICE_KEEP


@dataclass(frozen=True, slots=True)
class Answer:
    """What ``decide`` may return instead of bare operation ids: approvals and maintenance choices."""

    approved: tuple[str, ...] = ()
    choices: tuple[Choice, ...] = ()


def answer_of(result: "Answer | Iterable[str]") -> Answer:
    """What a controller's ``decide`` returned, as an ``Answer`` (bare operation ids approve, choose nothing)."""
    return result if isinstance(result, Answer) else Answer(tuple(result))


@dataclass(frozen=True, slots=True)
class Request:
    job_id: str
    entitlement: str
    controller: str
    sequence: int
    pending: tuple[Operation, ...] = ()
    completed: tuple[str, ...] = ()
    notices: tuple[AdvanceNotice, ...] = ()
    unhealthy: tuple[str, ...] = ()
    event_id: str = ""
    in_flight: tuple[str, ...] | None = None  # the scheduler's approved, not completed operations (None: not said)


def request_payload(r: Request) -> dict[str, Any]:
    return {
        "job_id": r.job_id, "controller": r.controller, "sequence": r.sequence,
        "pending_operations": [{"operation_id": o.operation_id, "task_id": o.task_id, "kind": o.kind,
                                "reason": o.reason} for o in r.pending],
        "completed_operation_ids": list(r.completed),
        "advance_notices": [{"unavailability_id": n.unavailability_id, "task_ids": list(n.task_ids),
                             "start_ms": n.start_ms, "deadline_ms": n.deadline_ms,
                             "expected_duration_ms": n.expected_duration_ms} for n in r.notices],
        "unhealthy_task_ids": list(r.unhealthy),
        "in_flight_operation_ids": None if r.in_flight is None else list(r.in_flight),
    }


def request_of(payload: Mapping[str, Any], entitlement: str = "", event_id: str = "") -> Request:
    return Request(
        job_id=payload["job_id"], entitlement=entitlement, controller=payload.get("controller", ""),
        sequence=payload["sequence"],
        pending=tuple(Operation(o["operation_id"], o["task_id"], o["kind"], o.get("reason", ""))
                      for o in payload["pending_operations"]),
        completed=tuple(payload.get("completed_operation_ids", ())),
        notices=tuple(AdvanceNotice(n["unavailability_id"], tuple(n["task_ids"]), n["start_ms"], n.get("deadline_ms"),
                                    n.get("expected_duration_ms")) for n in payload.get("advance_notices", ())),
        unhealthy=tuple(payload.get("unhealthy_task_ids", ())), event_id=event_id,
        in_flight=None if payload.get("in_flight_operation_ids") is None else tuple(payload["in_flight_operation_ids"]))


def ack_payload(job_id: str, sequence: int, approved: Iterable[str], controller: str,
                choices: Iterable[Choice] = ()) -> dict[str, Any]:
    """The TaskControlAcked payload; ``maintenance_choices`` only when there are some (the schema's default)."""
    p: dict[str, Any] = {"job_id": job_id, "sequence": sequence, "approved_operation_ids": list(approved),
                         "controller": controller}
    if choices := list(choices):
        p["maintenance_choices"] = [{"unavailability_id": c.unavailability_id, "task_id": c.task_id,
                                     "choice": c.choice} for c in choices]
    return p


def choices_of(payload: Mapping[str, Any]) -> tuple[Choice, ...]:
    """The maintenance choices of a TaskControlAcked payload (none in acks written before they existed)."""
    return tuple(Choice(c["unavailability_id"], c["task_id"], c["choice"])
                 for c in payload.get("maintenance_choices") or ())


def valid_choices(request: Request, choices: Iterable[Choice]) -> list[Choice]:
    """``choices`` restricted to tasks the request's advance notices name, a known choice, one per task and
    notice (the first wins), in the order given."""
    noticed = {(n.unavailability_id, t) for n in request.notices for t in n.task_ids}
    out, seen = [], set()
    for c in choices:
        key = (c.unavailability_id, c.task_id)
        if c.choice in CHOICES and key in noticed and key not in seen:
            seen.add(key)
            out.append(c)
    return out


def ack_refusal(latest: int, outstanding: bool, acked: int) -> str | None:
    """Why an ack of request ``acked`` does not count, given the job's ``latest`` request and whether it is
    still unanswered; None if it counts."""
    if acked < latest:
        return REASON_STALE_ACK
    if acked > latest:
        return REASON_UNKNOWN_SEQUENCE
    return None if outstanding else REASON_DUPLICATE_ACK


# -- the controller's bookkeeping -------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobBook:
    """What a controller knows of one job: the latest request answered, and the operations it approved that the
    scheduler has not reported completed (in flight)."""

    answered: int = 0  # sequence of the latest request answered (0: none)
    in_flight: Mapping[str, Operation] = field(default_factory=dict)  # operation id -> operation


@dataclass(frozen=True)
class View:
    """What ``decide`` sees beside the request: the operations it approved that are still in flight."""

    job_id: str
    in_flight: Mapping[str, Operation]

    @property
    def in_flight_tasks(self) -> frozenset[str]:
        return frozenset(o.task_id for o in self.in_flight.values())


def observe(book: JobBook, request: Request) -> JobBook:
    """Fold a request in. A request that says what the scheduler holds in flight sets the in-flight set to
    exactly that: an approval the scheduler never took (its ack went stale) or whose operation ended otherwise
    (replaced by a new operation on the task, the task retired) leaves it, and nothing stays in flight for ever.
    Older requests (``in_flight`` None): completed operations leave the in-flight set."""
    if request.in_flight is not None:
        return replace(book, in_flight={k: book.in_flight.get(k) or operation_of_id(k) for k in request.in_flight})
    if not request.completed:
        return book
    done = set(request.completed)
    return replace(book, in_flight={k: v for k, v in book.in_flight.items() if k not in done})


def operation_of_id(operation_id: str) -> Operation:
    """An operation from its id ``<task>:<kind>:<n>`` (the scheduler's form)."""
    task, _, rest = operation_id.partition(":")
    return Operation(operation_id, task, rest.partition(":")[0].upper())


def record_ack(book: JobBook, request: Request, approved: Iterable[str]) -> JobBook:
    """Fold in an ack of ``request`` (this controller's own, read back from the log or just sent)."""
    ops = {o.operation_id: o for o in request.pending}
    flight = dict(book.in_flight)
    for op_id in approved:
        if op_id in ops:
            flight[op_id] = ops[op_id]
    return JobBook(answered=max(book.answered, request.sequence), in_flight=flight)


def valid_approval(request: Request, approved: Iterable[str]) -> list[str]:
    """``approved`` restricted to the request's pending operations, in the request's order, once each."""
    wanted = set(approved)
    return [o.operation_id for o in request.pending if o.operation_id in wanted]
