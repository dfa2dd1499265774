"""Events that carry many items, and how readers see their items. Pure.

Where Twine has one event per job (or per tick), Ropewalk writes one record for many items:

* ``TasksCommanded`` (tasks): the scheduler's commands of one decision for one job (was: a ``TaskCommanded`` per
  task);
* ``TaskStatesChanged`` (tasks): an agent process's reports of one poll step for one entitlement, or the
  scheduler's own task transitions of one decision for one job (was: a ``TaskStateChanged`` per transition);
* ``MachinesStatusChanged`` (machines): one status change of many machines of one owner (was: a
  ``MachineStatusChanged`` per machine);
* ``MachinesRegistered`` (machines): the Resource Broker's registration of many machines of one owner key, at most
  ``REGISTRATIONS_PER_RECORD`` (was: a ``MachineRegistered`` per machine, a million records for a region);
* ``ServiceDiscoveryUpdated`` (tasks): the scheduler's service-discovery changes of one decision for one job
  (was: a ``ServiceDiscoveryChanged`` per task).

Old logs keep the single-item events, and readers take both: ``task_commands``, ``task_reports``,
``machine_statuses``, ``machine_registrations`` and ``discovery_changes`` give the items of either form as plain dicts with the single-item
event's field names.

**Size.** A record must stay below the broker's maximum message size (Kafka's default ``message.max.bytes`` is
1 MiB) whatever the job or region size: ``split`` cuts the items into parts of at most ``MAX_ITEMS`` items and
``MAX_RECORD_BYTES`` estimated bytes (the estimate, ``size_of``, bounds the Avro encoding from above: every
string counted with a 5-byte length prefix, every number as 10 bytes). What one part holds besides its items (the
envelope, argv/env) is given as ``fixed``; it must leave room for at least one item (``RecordTooLarge``).

**Ids.** Item ids stay derived and deterministic: a command's id is ``command_id(event id, position)`` (what an
agent de-duplicates by, and the causation of its reports); a batch of reports, each with its own derived
``report_id``, gets the id ``batch_id(kind, report ids)``, so the same reports batched again are recognised.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import orjson

from streams.events import Event, derived_event_id

MAX_RECORD_BYTES = 900_000  # bound of one record's encoded size (the broker's default limit is 1,048,576)
MAX_ITEMS = 5_000  # items per record at most, however small
ENVELOPE_BYTES = 1_024  # room for the envelope (six strings and two numbers; ids are 36 characters)

TASKS_COMMANDED = "TasksCommanded"
TASK_STATES_CHANGED = "TaskStatesChanged"
MACHINES_STATUS_CHANGED = "MachinesStatusChanged"
MACHINES_REGISTERED = "MachinesRegistered"
REGISTRATIONS_PER_RECORD = 1_000  # ~80 KB of Avro: the split's fast bound holds (json_bound), a record stays small
SERVICE_DISCOVERY_UPDATED = "ServiceDiscoveryUpdated"

T = TypeVar("T")


class RecordTooLarge(ValueError):
    """What every part must carry leaves no room for a single item."""


def size_of(value: Any) -> int:
    """An upper bound of ``value``'s Avro binary size (strings: length + 5; numbers and enums: 10)."""
    if value is None or isinstance(value, bool):
        return 1
    if isinstance(value, str):
        return len(value.encode()) + 5 if not value.isascii() else len(value) + 5
    if isinstance(value, (int, float)):
        return 10
    if isinstance(value, Mapping):
        return 10 + sum(size_of(k) + size_of(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 10 + sum(size_of(v) for v in value)
    return len(str(value)) + 5


JSON_BOUND = 3  # Avro bytes <= 3 x JSON characters + 10 for any JSON-able value (see json_bound)


def json_bound(value: Any) -> int:
    """An upper bound of ``value``'s Avro size from its compact JSON text: Avro writes no field names, no quotes,
    no separators; a string's length prefix (1 byte below 64 characters, 2 below 8,192) is at most its two quotes
    plus one byte per 8 KB; a number's varint or double at most 3 bytes per character of a 1..3-character number
    ("0.5": 8 bytes), fewer beyond; null and booleans 1 byte against 4..5 characters. The text is orjson's (UTF-8
    bytes: a string's as many as Avro writes, plus its quotes), the standard library's for what orjson refuses (an
    integer beyond 64 bits)."""
    try:
        text: bytes | str = orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:  # orjson.JSONEncodeError
        text = json.dumps(value, separators=(",", ":"), default=str)
    return JSON_BOUND * len(text) + 10


def split(items: Sequence[T], *, fixed: int = ENVELOPE_BYTES, size: Callable[[T], int] = size_of,
          max_bytes: int = MAX_RECORD_BYTES, max_items: int = MAX_ITEMS) -> list[list[T]]:
    """``items`` in order, cut into parts of at most ``max_items`` items whose sizes plus ``fixed`` stay within
    ``max_bytes``. No items: no parts. Raises RecordTooLarge when ``fixed`` plus one item exceeds the bound.

    With the default ``size``, each run of ``max_items`` items that surely fits one part is one part at once:
    ``JSON_BOUND`` times their JSON text (C-speed) bounds their Avro size from above, so ``size_of`` (a Python walk
    of every value, a tenth of the scheduler's time in a burst; 13 µs a machine of a region's registration) is run
    only for runs that may not fit."""
    if not items:
        return []
    if size is size_of:
        parts: list[list[T]] = []
        for i in range(0, len(items), max_items):
            run = items[i:i + max_items]
            if fixed + json_bound(run) <= max_bytes:
                parts.append(list(run))
            else:
                parts += _walk(run, fixed, size, max_bytes, max_items)
        return parts
    return _walk(items, fixed, size, max_bytes, max_items)


def _walk(items: Sequence[T], fixed: int, size: Callable[[T], int], max_bytes: int, max_items: int) -> list[list[T]]:
    """``split`` by every item's ``size``."""
    parts: list[list[T]] = []
    cur: list[T] = []
    used = fixed
    for item in items:
        n = size(item)
        if fixed + n > max_bytes:
            raise RecordTooLarge(f"one item of {n:,} bytes with {fixed:,} bytes of the record's own fields exceeds "
                                 f"{max_bytes:,} bytes")
        if cur and (used + n > max_bytes or len(cur) >= max_items):
            parts.append(cur)
            cur, used = [], fixed
        cur.append(item)
        used += n
    if cur:
        parts.append(cur)
    return parts


def command_id(event_id: str, position: int) -> str:
    """The id of the command at ``position`` (0-based) of the TasksCommanded ``event_id``."""
    return derived_event_id(event_id, "command", position)


def batch_id(kind: str, item_ids: Iterable[str]) -> str:
    """The id of a batch of items with these ids (derived from its content: the same items, the same id)."""
    return derived_event_id(kind, *item_ids)


def content_key(items: Sequence[Mapping[str, Any]], basis: Sequence[Any] = ()) -> str:
    """A short digest of a batch's items (their JSON, keys sorted): part of the id of a batch whose content a decision
    made again may change (``scheduler/work.JobWork.emit_batches``), so that one id never names two contents.
    ``basis``: what the decision found that the items do not show (a command's: when its task was last commanded), so
    that the same items decided on another state are another event, not a duplicate readers would drop."""
    doc = list(items) if not basis else [list(items), list(basis)]
    return hashlib.blake2b(orjson.dumps(doc, default=str, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS),
                           digest_size=8).hexdigest()


# -- readers: the items of either form ---------------------------------------------------------------------------

def task_commands(ev: Event, machines: Callable[[str], bool] | None = None) -> list[dict[str, Any]]:
    """The per-task commands of a TaskCommanded or a TasksCommanded (else none), each with the fields of a
    TaskCommanded payload plus ``command_id`` (the TaskCommanded's event id, or ``command_id(event, i)``). With
    ``machines``, only the commands addressed to a machine it accepts."""
    p = ev.payload
    if ev.type == "TaskCommanded":
        if machines is not None and not machines(p["machine_id"]):
            return []
        return [{**p, "host_profile": p.get("host_profile"), "command_id": ev.event_id}]
    if ev.type != TASKS_COMMANDED:
        return []
    out = []
    argv, env = p.get("argv") or [], p.get("env") or {}
    for i, c in enumerate(p["commands"]):
        if machines is not None and not machines(c["machine_id"]):
            continue
        starts = c["command"] != "STOP"
        out.append({"task_id": c["task_id"], "job_id": p["job_id"], "machine_id": c["machine_id"],
                    "command": c["command"], "argv": list(argv) if starts else [], "env": dict(env) if starts else {},
                    "spec_version": c.get("spec_version", 1), "reason": c.get("reason", ""),
                    "host_profile": p.get("host_profile"), "command_id": command_id(ev.event_id, i)})
    return out


def command_events(ev: Event, machines: Callable[[str], bool] | None = None) -> list[Event]:
    """``task_commands`` as TaskCommanded events (the form an agent's decisions take), each with the command's id
    as its event id and the batch's envelope (and proven identity) otherwise."""
    if ev.type == "TaskCommanded":
        return [ev] if machines is None or machines(ev.payload["machine_id"]) else []
    out = []
    for c in task_commands(ev, machines):
        cid = c.pop("command_id")
        out.append(Event(type="TaskCommanded", entitlement=ev.entitlement, entity_id=c["task_id"], payload=c,
                         producer=ev.producer, causation_id=ev.causation_id, timestamp_ms=ev.timestamp_ms,
                         event_id=cid, schema_version=ev.schema_version, identity=ev.identity))
    return out


def task_reports(ev: Event) -> list[dict[str, Any]]:
    """The per-task transitions of a TaskStateChanged or a TaskStatesChanged (else none), each with the fields
    of a TaskStateChanged payload plus ``report_id`` and ``cause_id`` (for a TaskStateChanged: its event id and
    causation id)."""
    if ev.type == "TaskStateChanged":
        return [{**ev.payload, "report_id": ev.event_id, "cause_id": ev.causation_id}]
    if ev.type != TASK_STATES_CHANGED:
        return []
    return [dict(r) for r in ev.payload["reports"]]


def machine_statuses(ev: Event) -> list[dict[str, Any]]:
    """The per-machine changes of a MachineStatusChanged or a MachinesStatusChanged (else none), each with the
    fields of a MachineStatusChanged payload (machine_id, status, previous_status, reason)."""
    p = ev.payload
    if ev.type == "MachineStatusChanged":
        return [dict(p)]
    if ev.type != MACHINES_STATUS_CHANGED:
        return []
    return [{"machine_id": m["machine_id"], "status": p["status"], "previous_status": m["previous_status"],
             "reason": p.get("reason", "")} for m in p["machines"]]


def machine_registrations(ev: Event) -> list[Mapping[str, Any]]:
    """The per-machine registrations of a MachineRegistered or a MachinesRegistered (else none), each with the fields
    of a MachineRegistered payload (machine_id, topology, machine_type, capacity, host_profile); the items are the
    event's own (not copied): read them, do not change them."""
    if ev.type == "MachineRegistered":
        return [ev.payload]
    if ev.type != MACHINES_REGISTERED:
        return []
    return ev.payload["machines"]


def discovery_changes(ev: Event) -> list[dict[str, Any]]:
    """The per-task changes of a ServiceDiscoveryChanged or a ServiceDiscoveryUpdated (else none), each with the
    fields of a ServiceDiscoveryChanged payload (task_id, job_id, machine_id, enabled, reason)."""
    p = ev.payload
    if ev.type == "ServiceDiscoveryChanged":
        return [dict(p)]
    if ev.type != SERVICE_DISCOVERY_UPDATED:
        return []
    return [{"task_id": c["task_id"], "job_id": p["job_id"], "machine_id": c.get("machine_id"),
             "enabled": c["enabled"], "reason": c.get("reason", "")} for c in p["changes"]]


def machine_ids(ev: Event) -> list[str]:
    """The machines an event names: ``machine_id``, ``machine_ids``, or the machines of a MachinesStatusChanged or a
    MachinesRegistered."""
    p = ev.payload
    if ev.type in (MACHINES_STATUS_CHANGED, MACHINES_REGISTERED):
        return [m["machine_id"] for m in p["machines"]]
    if "machine_ids" in p:
        return list(p["machine_ids"])
    return [p["machine_id"]] if p.get("machine_id") is not None else []


# -- writers ---------------------------------------------------------------------------------------------------

def report_item(ev: Event) -> dict[str, Any]:
    """A TaskStateChanged as an item of a TaskStatesChanged."""
    p = ev.payload
    return {"report_id": ev.event_id, "task_id": p["task_id"], "job_id": p["job_id"], "machine_id": p.get("machine_id"),
            "state": p["state"], "previous_state": p["previous_state"], "exit_code": p.get("exit_code"),
            "spec_version": p.get("spec_version", 1), "reason": p.get("reason", ""), "cause_id": ev.causation_id}


def batch_reports(reports: Iterable[Event], *, producer: str, timestamp_ms: int) -> list[Event]:
    """TaskStateChanged events → TaskStatesChanged events, one per entitlement (in order of first appearance; the
    reports in their order), split by ``split``. Each batch's id is ``batch_id`` of its reports' ids; its
    entity id is the first report's task, its causation the first report's cause."""
    by_ent: dict[str, list[dict[str, Any]]] = {}
    for ev in reports:
        by_ent.setdefault(ev.entitlement, []).append(report_item(ev))
    out = []
    for ent, items in by_ent.items():
        for part in split(items):
            out.append(Event(type=TASK_STATES_CHANGED, entitlement=ent, entity_id=part[0]["task_id"],
                             payload={"reports": part}, producer=producer, causation_id=part[0]["cause_id"],
                             timestamp_ms=timestamp_ms,
                             event_id=batch_id(TASK_STATES_CHANGED, (r["report_id"] for r in part))))
    return out
