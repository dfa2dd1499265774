"""Elastic compute: the Resource Broker lends idle machines to elastic entitlements and takes them back. Pure.

Twine (Systems @Scale 2019, "elastic compute"; §2.7): online services are downsized off-peak and the freed whole
machines go to delay-tolerant work; "if the online service experiences a load spike, Resource Broker quickly
revokes the loaned server and works with the scheduler to return the server back to the online service".

**A loan is quota.** Machines join an entitlement only through the allocator (one writer of ownership: its commit
is the optimistic check of §2.3), so the Resource Broker lends by raising an elastic borrower's quota
(``LoanGranted`` + an ``EntitlementUpdated``, quota = the borrower's own + what it borrows); the allocator then
places the borrower's waiting tasks on free machines as usual. The lender is the entitlement whose idle quota (the
machines it may hold and does not: an autoscaled service off-peak) backs the loan, or the free pool; an
entitlement that sets ``lend_idle`` false keeps its idle quota out of any loan.

**Taking back.** When machines are short — an owner's tasks wait for want of a free machine (an
``AllocationRejected`` ``no_feasible_machine`` of a non-elastic entitlement), or the free pool is below the
headroom — the broker takes back what is lent: first the lent quota the borrower does not use (nothing to move),
then whole machines: ``LoanRevoked`` names them, the quota shrinks, and an ``UnavailabilityStarted`` of kind
MAINTENANCE with ``vacate`` on them (keyed to the borrower) is the notice: the allocator places nothing more on
them, the borrower's TaskControllers get advance notice and may move their tasks before the deadline (KEEP and
STOP are refused: ``must_vacate``), and at the deadline the scheduler stops and moves what is left. Once the
borrower's last task is off a machine the allocator releases it to the free pool (``MachineReleasedToFreePool``):
``LoanReturned`` (how long it took against ``bound_ms``), and when all of a revocation's machines are back its
``UnavailabilityEnded``, after which the owner's waiting tasks are placed on them.

**The rules, one table (``RULES``), in the order a tick applies them.** Ticks are the worker's timer
(``tick(book, now)``); everything else is a fold of the log (``apply``): machines (owner, status), maintenance
windows, entitlements (own quota, elasticity), the allocator's answers (demand), and the broker's own loan events
(facts: a restarted worker knows what it lent).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

from processors.allocator.placement import NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED
from processors.resourcebroker import decide as rb
from streams import batches
from streams.enums import UnavailabilityKind
from streams.events import Event, derived_event_id, new_event
from streams.topics import FREE_POOL_LENDER

PRODUCER = "resourcebroker/loans"
REVOKE_REASON = "loan_revoked"  # UnavailabilityStarted.reason of a revocation's notice
MACHINE_TYPES = frozenset(rb.MACHINE_EVENTS)
TOPICS = ("machines", "intents", "unavailability", "allocations", "loans")  # what the lender folds
CONSUMED = frozenset({*MACHINE_TYPES, "EntitlementCreated", "EntitlementUpdated", "EntitlementElasticityChanged",
                      "UnavailabilityStarted", "UnavailabilityEnded", "AllocationRejected", "TasksAllocated",
                      "LoanGranted", "LoanRevoked", "LoanReturned"})


@dataclass(frozen=True)
class Tuning:
    headroom_machines: int = 2  # free machines never lent (and taken back to when the free pool falls below)
    demand_window_ms: int = 30_000  # a rejection counts as demand this long (the scheduler asks again every 10 s)
    lend_cooldown_ms: int = 60_000  # no new loan to a borrower this soon after taking some back (no flapping)
    bound_ms: int = 60_000  # a machine taken back should be free again within this (LoanReturned.bound_ms)
    revocation_duration_ms: int = 60_000  # the notice's expected duration (UnavailabilityStarted)


@dataclass(frozen=True, slots=True)
class Elasticity:
    elastic: bool = False
    max_borrowed: int = 0
    notice_ms: int = 30_000
    lend_idle: bool = True


@dataclass(frozen=True, slots=True)
class Loan:
    loan_id: str
    borrower: str
    lender: str
    machines: int  # quota lent and not taken back yet


@dataclass(frozen=True, slots=True)
class Revocation:
    revocation_id: str
    borrower: str
    machines: tuple[str, ...]
    revoked_at: int
    deadline: int
    returned: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoanBook:
    broker: rb.BrokerState = field(default_factory=rb.BrokerState)
    quota: Mapping[str, int] = field(default_factory=dict)  # entitlement -> its own quota (set by its owner)
    elasticity: Mapping[str, Elasticity] = field(default_factory=dict)
    loans: tuple[Loan, ...] = ()  # outstanding, oldest first
    revocations: Mapping[str, Revocation] = field(default_factory=dict)  # open ones
    maintenance: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # machine -> open UEs on it
    demand: Mapping[str, tuple[str, str, int, int]] = field(default_factory=dict)  # job -> (ent, reason, tasks, at)
    revoked_at: Mapping[str, int] = field(default_factory=dict)  # borrower -> its latest revocation
    seq: int = 0  # names the next loan / revocation
    decided: frozenset[str] = frozenset()  # loan and revocation ids applied (a decision read again changes nothing)


# -- folding the log -------------------------------------------------------------------------------------------

def _with(book: LoanBook, **changes: Any) -> LoanBook:
    frozen: dict[str, Any] = {k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in changes.items()}
    return dataclasses.replace(book, **frozen)


def lent(book: LoanBook, borrower: str) -> int:
    return sum(x.machines for x in book.loans if x.borrower == borrower)


def apply(book: LoanBook, ev: Event, tuning: "Tuning | None" = None) -> tuple[LoanBook, list[Event]]:  # noqa: C901
    """Fold one event of the log. The only events it emits are returns: a machine under a revocation that its
    borrower released (LoanReturned; UnavailabilityEnded once the revocation's machines are all back)."""
    p = ev.payload
    t = ev.type
    if t in MACHINE_TYPES:
        before = {m: book.broker.get(m) for m in batches.machine_ids(ev)}
        book = _with(book, broker=rb.apply(book.broker, ev))
        return _returns(book, ev, before, (tuning or Tuning()).bound_ms)
    if t in ("EntitlementCreated", "EntitlementUpdated"):
        if ev.producer != PRODUCER and p.get("quota_machines") is not None and p["quota_machines"] >= 0:
            return _with(book, quota={**book.quota, ev.entitlement: p["quota_machines"]}), []
        return book, []
    if t == "EntitlementElasticityChanged":
        e = Elasticity(p["elastic"], p.get("max_borrowed_machines", 0), p.get("revoke_notice_ms", 30_000),
                       p.get("lend_idle", True))
        return _with(book, elasticity={**book.elasticity, ev.entitlement: e}), []
    if t == "UnavailabilityStarted" and p["kind"] == UnavailabilityKind.MAINTENANCE:
        m = dict(book.maintenance)
        for mid in p["machine_ids"]:
            m[mid] = tuple(sorted({*m.get(mid, ()), p["unavailability_id"]}))
        return _with(book, maintenance=m), []
    if t == "UnavailabilityEnded":
        m = dict(book.maintenance)
        for mid in p["machine_ids"]:
            left = tuple(u for u in m.get(mid, ()) if u != p["unavailability_id"])
            m.pop(mid, None) if not left else m.__setitem__(mid, left)  # a failure's end: no maintenance held
        return _with(book, maintenance=m), []
    if t in ("AllocationRejected", "TasksAllocated"):
        demand = dict(book.demand)
        demand.pop(p["job_id"], None)
        if t == "AllocationRejected" and p["reason"] in (NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED):
            demand[p["job_id"]] = (ev.entitlement, p["reason"], len(p["unplaced_task_ids"]), ev.timestamp_ms)
        return _with(book, demand=demand), []
    if t in ("LoanGranted", "LoanRevoked", "LoanReturned"):
        return apply_own(book, ev), []
    return book, []


def apply_own(book: LoanBook, ev: Event) -> LoanBook:
    """The broker's own loan events (what ``tick`` decides, and what a restarted worker reads back)."""
    p = ev.payload
    own_id = p.get("loan_id") or (p["revocation_id"] if ev.type == "LoanRevoked" else None)
    if own_id is not None:
        if own_id in book.decided:
            return book
        book = _with(book, decided=book.decided | {own_id})
    if ev.type == "LoanGranted":
        seq = int(p["loan_id"].rsplit("/", 1)[1])
        return _with(book, loans=(*book.loans, Loan(p["loan_id"], ev.entitlement, p["lender"], p["machines"])),
                     seq=max(book.seq, seq))
    if ev.type == "LoanRevoked":
        seq = int(p["revocation_id"].rsplit("/", 1)[1])
        loans = _take_back(book.loans, ev.entitlement, p["quota_before"] - p["quota_after"])
        revs = dict(book.revocations)
        if p["machine_ids"]:
            revs[p["revocation_id"]] = Revocation(p["revocation_id"], ev.entitlement, tuple(p["machine_ids"]),
                                                  ev.timestamp_ms, p["deadline_ms"])
        return _with(book, loans=loans, revocations=revs, revoked_at={**book.revoked_at, ev.entitlement:
                                                                      ev.timestamp_ms}, seq=max(book.seq, seq))
    # LoanReturned
    rev = book.revocations.get(p["revocation_id"])
    if rev is None or p["machine_id"] in rev.returned:
        return book
    rev = dataclasses.replace(rev, returned=(*rev.returned, p["machine_id"]))
    revs = dict(book.revocations)
    if set(rev.returned) >= set(rev.machines):
        revs.pop(rev.revocation_id)
    else:
        revs[rev.revocation_id] = rev
    return _with(book, revocations=revs)


def _take_back(loans: tuple[Loan, ...], borrower: str, n: int) -> tuple[Loan, ...]:
    """``loans`` with ``n`` machines of ``borrower``'s taken back, newest loan first."""
    out = []
    for loan in reversed(loans):
        if loan.borrower == borrower and n > 0:
            k = min(n, loan.machines)
            n -= k
            if loan.machines > k:
                out.append(dataclasses.replace(loan, machines=loan.machines - k))
            continue
        out.append(loan)
    return tuple(reversed(out))


def _returns(book: LoanBook, ev: Event, before: Mapping[str, rb.MachineRecord | None], bound_ms: int
             ) -> tuple[LoanBook, list[Event]]:
    out: list[Event] = []
    for rev in list(book.revocations.values()):
        for mid in rev.machines:
            if mid in rev.returned or mid not in before:
                continue
            was, now = before[mid], book.broker.get(mid)
            if was is None or was.owner != rev.borrower or now is None or now.owner == rev.borrower:
                continue
            took = ev.timestamp_ms - rev.revoked_at
            returned = _event("LoanReturned", rev.borrower, mid, {
                "revocation_id": rev.revocation_id, "machine_id": mid, "revoked_at_ms": rev.revoked_at,
                "returned_at_ms": ev.timestamp_ms, "took_ms": took, "bound_ms": bound_ms}, ev, "returned", mid)
            out.append(returned)
            book = apply_own(book, returned)
            if rev.revocation_id not in book.revocations:  # all back: the notice is over
                ended = _event("UnavailabilityEnded", rev.borrower, rev.revocation_id, {
                    "unavailability_id": rev.revocation_id, "machine_ids": list(rev.machines)}, ev, "ended")
                out.append(ended)
                book, _ = apply(book, ended)  # free at once: the next tick must not see it under the notice
            rev = book.revocations.get(rev.revocation_id, rev)
    return book, out


def _event(type_: str, entitlement: str, entity: str, payload: Mapping[str, Any], cause: Event | None, *disc: Any,
           now: int | None = None) -> Event:
    root = cause.event_id if cause is not None else f"tick/{now}"
    return new_event(type_, payload, entitlement=entitlement, entity_id=entity, producer=PRODUCER,
                     causation_id=cause.event_id if cause is not None else None,
                     timestamp_ms=cause.timestamp_ms if cause is not None else now,
                     event_id=derived_event_id(root, PRODUCER, type_, *disc))


# -- the picture a tick decides on ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Picture:
    now: int
    free: int  # free machines, UP, under no maintenance
    held: Mapping[str, list[str]]  # entitlement -> its machines (sorted)
    vacating: frozenset[str]  # machines under an open revocation
    owner_demand: Mapping[str, int]  # non-elastic entitlement -> tasks waiting for a free machine
    borrower_demand: Mapping[str, int]  # elastic entitlement -> tasks waiting for quota
    reserved: int  # idle quota of entitlements that do not lend it
    unused: Mapping[str, int]  # borrower -> lent quota it does not use


def picture(book: LoanBook, now: int, tuning: Tuning) -> Picture:
    held: dict[str, list[str]] = {}
    free = 0
    for m in book.broker.machines.values():
        if m.owner is None:
            free += rb.is_free(m.owner, m.status, bool(book.maintenance.get(m.id)))
        else:
            held.setdefault(m.owner, []).append(m.id)
    for ids in held.values():
        ids.sort()
    owner_demand: dict[str, int] = {}
    borrower_demand: dict[str, int] = {}
    for ent, reason, tasks, at in book.demand.values():
        if now - at > tuning.demand_window_ms:
            continue
        elastic = book.elasticity.get(ent, Elasticity()).elastic
        if elastic and reason == QUOTA_EXCEEDED:
            borrower_demand[ent] = borrower_demand.get(ent, 0) + tasks
        elif not elastic and reason == NO_FEASIBLE_MACHINE:
            owner_demand[ent] = owner_demand.get(ent, 0) + tasks
    reserved = sum(max(0, q - len(held.get(e, ()))) for e, q in book.quota.items()
                   if not book.elasticity.get(e, Elasticity()).lend_idle)
    vacating = frozenset(m for r in book.revocations.values() for m in r.machines if m not in r.returned)
    unused = {}
    for b in {x.borrower for x in book.loans}:
        used = max(0, len([m for m in held.get(b, ()) if m not in vacating]) - book.quota.get(b, 0))
        unused[b] = max(0, lent(book, b) - used)
    return Picture(now, free, held, vacating, owner_demand, borrower_demand, reserved, unused)


# -- the rules ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    name: str
    says: str
    act: Callable[[LoanBook, Picture, Tuning], tuple[LoanBook, list[Event]]]


def _shortfall(book: LoanBook, pic: Picture, tuning: Tuning) -> int:
    """Machines to take back: what owners wait for, and the free pool back to half the headroom (a band: loans stop
    at the headroom, take-backs start below half of it), less what is returning already."""
    returning = len(pic.vacating)
    return tuning.headroom_machines // 2 + sum(pic.owner_demand.values()) - pic.free - returning


def _revoke(book: LoanBook, pic: Picture, tuning: Tuning) -> tuple[LoanBook, list[Event]]:
    short = _shortfall(book, pic, tuning)
    out: list[Event] = []
    if short <= 0 or not book.loans:
        return book, out
    why = (", ".join(f"{e} waits for {n} machines" for e, n in sorted(pic.owner_demand.items()))
           or f"the free pool ({pic.free}) is below the headroom ({tuning.headroom_machines})")
    by_use = sorted({x.borrower for x in book.loans}, key=lambda b: (-lent(book, b), b))
    for b in by_use:
        if short <= 0:
            break
        own = book.quota.get(b, 0)
        borrowed = [m for m in pic.held.get(b, ()) if m not in pic.vacating]
        in_use = max(0, len(borrowed) - own)
        machines = tuple(sorted(borrowed, reverse=True)[:min(short, in_use)])
        unused = pic.unused.get(b, 0)
        if not machines and not unused:
            continue
        before = own + lent(book, b)
        after = before - unused - len(machines)
        seq = book.seq + 1
        rid = f"revocation/{b}/{seq}"
        notice = book.elasticity.get(b, Elasticity()).notice_ms
        deadline = pic.now + notice
        lenders = sorted({x.lender for x in book.loans if x.borrower == b})
        revoked = _event("LoanRevoked", b, rid, {
            "revocation_id": rid, "machine_ids": list(machines), "unused_machines": unused, "lenders": lenders,
            "quota_before": before, "quota_after": after, "notice_ms": notice, "deadline_ms": deadline,
            "reason": f"take_back: {why}"}, None, rid, now=pic.now)
        out.append(revoked)
        out.append(_quota(b, after, pic.now, rid))
        if machines:
            out.append(_event("UnavailabilityStarted", b, rid, {
                "unavailability_id": rid, "kind": UnavailabilityKind.MAINTENANCE, "machine_ids": list(machines),
                "start_ms": deadline, "deadline_ms": deadline, "expected_duration_ms": tuning.revocation_duration_ms,
                "reason": REVOKE_REASON, "vacate": True}, None, rid, now=pic.now))
        book = apply_own(book, revoked)
        short -= len(machines)
    return book, out


def _lend(book: LoanBook, pic: Picture, tuning: Tuning) -> tuple[LoanBook, list[Event]]:
    out: list[Event] = []
    if _shortfall(book, pic, tuning) > 0 or pic.owner_demand or pic.vacating:
        return book, out
    room = pic.free - tuning.headroom_machines - pic.reserved - sum(pic.unused.values())
    for b, want in sorted(pic.borrower_demand.items()):
        pol = book.elasticity.get(b, Elasticity())
        last = book.revoked_at.get(b)
        # quota lent and not in use yet answers the demand that asked for it (the allocator has not placed on it)
        give = min(want - pic.unused.get(b, 0), pol.max_borrowed - lent(book, b), room)
        if give <= 0 or (last is not None and pic.now - last < tuning.lend_cooldown_ms):
            continue
        idle = sorted(((max(0, q - len(pic.held.get(e, ()))), e) for e, q in book.quota.items()
                       if e != b and book.elasticity.get(e, Elasticity()).lend_idle
                       and not book.elasticity.get(e, Elasticity()).elastic), reverse=True)
        lender = idle[0][1] if idle and idle[0][0] >= give else FREE_POOL_LENDER
        own = book.quota.get(b, 0)
        before = own + lent(book, b)
        seq = book.seq + 1
        loan_id = f"loan/{b}/{seq}"
        granted = _event("LoanGranted", b, loan_id, {
            "loan_id": loan_id, "lender": lender, "machines": give, "quota_before": before,
            "quota_after": before + give, "reason": f"lend: {b} waits for quota for {want} tasks",
            "free_machines": pic.free, "headroom": tuning.headroom_machines, "demand_tasks": want},
            None, loan_id, now=pic.now)
        out += [granted, _quota(b, before + give, pic.now, loan_id)]
        book = apply_own(book, granted)
        room -= give
    return book, out


def _quota(entitlement: str, quota: int, now: int, cause: str) -> Event:
    return _event("EntitlementUpdated", entitlement, entitlement, {
        "quota_machines": quota, "machine_type": None, "dc_pin": None, "host_profile": None}, None, cause, now=now)


RULES: tuple[Rule, ...] = (
    Rule("take_back_when_short", "an owner's tasks wait for a free machine, or the free pool is below half the headroom "
         "(machines already returning count): take back lent quota not in use, then whole machines, from the "
         "borrower that borrowed most, with notice (vacate) through TaskControl", _revoke),
    Rule("lend_to_waiting_borrowers", "an elastic entitlement's tasks wait for quota, nobody is short, the free pool "
         "beyond the headroom, the idle quota of entitlements that do not lend it and lent quota not in use has room, "
         "and the borrower's last take-back is older than the cooldown: lend what its waiting tasks need beyond the "
         "quota lent to it and not in use yet, up to its max_borrowed_machines", _lend),
)


def rules_table() -> list[dict]:
    return [{"rule": r.name, "says": r.says} for r in RULES]


def tick(book: LoanBook, now: int, tuning: Tuning = Tuning()) -> tuple[LoanBook, list[Event]]:
    """The timer's decision: the rules in order, on one picture of the book."""
    out: list[Event] = []
    for rule in RULES:
        book, events = rule.act(book, picture(book, now, tuning), tuning)
        out += events
    return book, out


def view(book: LoanBook, now: int, tuning: Tuning = Tuning()) -> dict:
    """`ropewalk loans --json`: what is lent, being taken back, and the picture the next tick decides on."""
    pic = picture(book, now, tuning)
    return {"free_machines": pic.free, "headroom": tuning.headroom_machines,
            "loans": [{"loan_id": x.loan_id, "borrower": x.borrower, "lender": x.lender, "machines": x.machines}
                      for x in book.loans],
            "revocations": [{"revocation_id": r.revocation_id, "borrower": r.borrower, "machines": list(r.machines),
                             "returned": list(r.returned), "revoked_at_ms": r.revoked_at, "deadline_ms": r.deadline,
                             "overdue": now - r.revoked_at > tuning.bound_ms} for r in book.revocations.values()],
            "elastic": {e: dataclasses.asdict(p) for e, p in sorted(book.elasticity.items())},
            "owner_demand": dict(pic.owner_demand), "borrower_demand": dict(pic.borrower_demand)}
