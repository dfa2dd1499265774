"""Elastic loans' pure decisions (processors/resourcebroker/loans.py): lend idle machines to an elastic entitlement
whose tasks wait for quota, take them back with notice when an owner's tasks wait for a machine, announce each
machine returned with how long it took against the bound. Every emitted event encodes with the real schemas; the
same input on the same book gives the same output."""
import pytest

from processors.allocator.placement import NO_FEASIBLE_MACHINE, QUOTA_EXCEEDED
from processors.resourcebroker import decide as rb
from processors.resourcebroker import loans as ln
from processors.resourcebroker import loans_view
from processors.resourcebroker.region import generate_region, iter_machines
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000
_n = iter(range(10**9))


def ev(type_, payload, ent, producer="cli", ts=T0):
    return new_event(type_, payload, entitlement=ent, entity_id=payload.get("machine_id", ent), producer=producer,
                     timestamp_ms=ts, event_id=f"in-{type_}-{next(_n)}")


def registered(n):
    _, events = rb.register_all(rb.BrokerState(), iter_machines(generate_region(n)), T0)
    return events


def machine_ids(n):
    """The ids of ``registered(n)``'s machines, in order."""
    return [m.id for m in iter_machines(generate_region(n))]


def entitlement(name, quota):
    return ev("EntitlementCreated", {"name": name, "quota_machines": quota, "machine_type": None, "dc_pin": None,
                                     "host_profile": None}, name)


def elastic(name, max_borrowed=4, notice_ms=5_000, lend_idle=True, is_elastic=True):
    return ev("EntitlementElasticityChanged", {"elastic": is_elastic, "max_borrowed_machines": max_borrowed,
                                               "revoke_notice_ms": notice_ms, "lend_idle": lend_idle}, name)


def rejected(ent, job, reason, tasks, ts=T0):
    return ev("AllocationRejected", {"request_id": f"r{next(_n)}", "job_id": job, "reason": reason, "message": "",
                                     "unplaced_task_ids": [f"{job}/{i}" for i in range(tasks)],
                                     "filter_rejections": {}}, ent, producer="allocator", ts=ts)


def assigned(machine, ent, ts=T0):
    return ev("MachineAssignedToEntitlement", {"machine_id": machine, "dc": "dc1", "reason": "placement"}, ent,
              producer="allocator", ts=ts)


def released(machine, ent, ts):
    return ev("MachineReleasedToFreePool", {"machine_id": machine, "dc": "dc1", "reason": "empty"}, ent,
              producer="allocator", ts=ts)


class Book:
    def __init__(self, tuning=ln.Tuning(headroom_machines=2, lend_cooldown_ms=60_000, bound_ms=60_000)):
        self.book, self.tuning = ln.LoanBook(), tuning
        self.emitted = []

    def _out(self, out):
        for e in out:
            REG.encode(e.type, e.to_record(schema_version=1))
        self.emitted += out
        return out

    def feed(self, *events):
        out = []
        for e in events:
            new, got = ln.apply(self.book, e, self.tuning)
            assert ln.apply(self.book, e, self.tuning) == (new, got), "same input, same book: same output"
            self.book = new
            out += got
        return self._out(out)

    def tick(self, now):
        new, out = ln.tick(self.book, now, self.tuning)
        assert ln.tick(self.book, now, self.tuning) == (new, out)
        self.book = new
        for e in out:  # the quota it sets is read back like any EntitlementUpdated (and must not count as own)
            self.book, _ = ln.apply(self.book, e, self.tuning)
        return self._out(out)


def types(out):
    return [e.type for e in out]


def lending(n_machines=10, max_borrowed=4):
    b = Book()
    b.feed(*registered(n_machines), entitlement("web", 6), entitlement("batch", 0), elastic("batch", max_borrowed))
    return b


def test_an_elastic_entitlement_waiting_for_quota_borrows_up_to_its_max_and_the_headroom():
    b = lending(10, max_borrowed=4)
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 6))
    out = b.tick(T0 + 1000)
    assert types(out) == ["LoanGranted", "EntitlementUpdated"]
    loan, quota = out[0].payload, out[1].payload
    assert (loan["machines"], loan["quota_before"], loan["quota_after"]) == (4, 0, 4)
    assert loan["lender"] == "web"  # web's idle quota (6 of 6 unused) backs the loan
    assert quota["quota_machines"] == 4 and out[1].entitlement == "batch"
    assert b.tick(T0 + 2000) == [], "lent up to max_borrowed: nothing more"


@pytest.mark.parametrize("case, setup, want", [
    ("not elastic", lambda b: b.feed(elastic("batch", is_elastic=False)), []),
    ("no headroom", lambda b: b.feed(*[assigned(m, "web") for m in machine_ids(10)[:9]]), []),
    ("owner waits", lambda b: b.feed(rejected("web", "web.api", NO_FEASIBLE_MACHINE, 1)), []),
    ("demand is old", lambda b: None, "old"),
])
def test_no_loan_when(case, setup, want):
    b = lending(10)
    setup(b)
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 3, ts=T0 - 31_000 if want == "old" else T0))
    assert [e for e in b.tick(T0 + 1000) if e.type == "LoanGranted"] == [], case


def test_an_owner_short_of_machines_takes_them_back_with_notice_and_each_return_is_timed():
    b = lending(10, max_borrowed=4)
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 4))
    b.tick(T0 + 1000)
    ids = machine_ids(10)
    borrowed = ids[:4]
    b.feed(*[assigned(m, "batch", T0 + 2000) for m in borrowed])  # the allocator placed batch on 4 free machines
    b.feed(*[assigned(m, "web", T0 + 2000) for m in ids[4:8]])  # web holds 4 of its 6; 2 free = the headroom
    b.feed(rejected("web", "web.api", NO_FEASIBLE_MACHINE, 2, ts=T0 + 3000))
    out = b.tick(T0 + 4000)
    assert types(out) == ["LoanRevoked", "EntitlementUpdated", "UnavailabilityStarted"]
    rev, quota, notice = (e.payload for e in out)
    # short: web waits for 2, half the headroom (1) is kept free, 2 are free: 1 machine back
    assert len(rev["machine_ids"]) == 1 and set(rev["machine_ids"]) <= set(borrowed)
    assert (rev["quota_before"], rev["quota_after"]) == (4, 3)
    assert notice["vacate"] and notice["kind"] == rb.KIND_MAINTENANCE and notice["machine_ids"] == rev["machine_ids"]
    assert notice["deadline_ms"] == T0 + 4000 + 5_000  # the borrower's notice
    assert b.tick(T0 + 5000) == [], "what is returning counts: no second revocation for the same shortfall"
    back = b.feed(released(rev["machine_ids"][0], "batch", T0 + 11_000))
    assert types(back) == ["LoanReturned", "UnavailabilityEnded"]
    assert back[0].payload["took_ms"] == 7000 and back[0].payload["bound_ms"] == 60_000
    assert back[1].payload["unavailability_id"] == rev["revocation_id"]
    assert b.feed(released(rev["machine_ids"][0], "batch", T0 + 11_000)) == [], "a release read twice: nothing"
    assert ln.view(b.book, T0 + 12_000)["loans"][0]["machines"] == 3
    # the loans page's history, and what a user of one entitlement sees of it
    lender = next(e.payload["lender"] for e in b.emitted if e.type == "LoanGranted")
    hist = loans_view.history(b.emitted)
    assert [(h["kind"], h["borrower"], h["lenders"], h["machines"], h["deadline_ms"]) for h in hist] == [
        ("granted", "batch", [lender], 4, None), ("revoked", "batch", rev["lenders"], 1, T0 + 9000),
        ("returned", "batch", [], 1, None)]
    assert hist[2]["machine_ids"] == rev["machine_ids"] and hist[2]["at_ms"] == T0 + 11_000
    doc = {**ln.view(b.book, T0 + 12_000), "returns": [dict(back[0].payload, borrower="batch")], "history": hist}
    assert loans_view.only(doc, ["batch", "web"])["history"] == hist
    assert loans_view.only(doc, "other") == {**doc, "loans": [], "revocations": [], "returns": [], "history": [],
                                             "elastic": {}, "owner_demand": {}, "borrower_demand": {},
                                             "returned_p99_ms": None}


def test_lent_quota_not_in_use_goes_back_first_and_no_new_loan_within_the_cooldown():
    b = lending(10, max_borrowed=4)
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 4))
    b.tick(T0 + 1000)
    ids = machine_ids(10)
    b.feed(*[assigned(m, "web", T0 + 2000) for m in ids])  # web took every machine: below half the headroom
    out = b.tick(T0 + 3000)
    assert types(out) == ["LoanRevoked", "EntitlementUpdated"], "nothing to vacate: batch used none of it"
    assert out[0].payload["unused_machines"] == 4 and out[0].payload["machine_ids"] == []
    b.feed(*[released(m, "web", T0 + 4000) for m in ids])
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 4, ts=T0 + 5000))
    assert b.tick(T0 + 6000) == [], "within the cooldown after a take-back"
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 4, ts=T0 + 64_000))
    assert types(b.tick(T0 + 64_000)) == ["LoanGranted", "EntitlementUpdated"]


def test_a_restarted_lender_reads_its_decisions_back_and_decides_alike():
    live = lending(10, max_borrowed=4)
    inputs = [rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 4)]
    live.feed(*inputs)
    decided = live.tick(T0 + 1000)
    again = lending(10, max_borrowed=4)
    again.feed(*inputs, *decided)  # what a restarted worker reads from the log
    assert again.book.loans == live.book.loans and again.book.seq == live.book.seq
    assert again.tick(T0 + 2000) == []


def test_the_rules_table_names_each_rule_once():
    names = [r["rule"] for r in ln.rules_table()]
    assert names == ["take_back_when_short", "lend_to_waiting_borrowers"] and len(set(names)) == len(names)


@pytest.mark.parametrize("started_kind", [None, "FAILURE"])
def test_the_end_of_an_unavailability_the_lender_holds_no_maintenance_for_is_folded(started_kind):
    """A machine's failure ends (`machine recover`: UnavailabilityEnded of a FAILURE, which the lender does not
    hold): folding it changes nothing (it raised KeyError, so the lender worker and the loans view crashed)."""
    b = lending(4)
    machine = next(iter_machines(generate_region(4))).id
    if started_kind:
        b.feed(ev("UnavailabilityStarted", {"unavailability_id": "ue-f", "kind": started_kind, "machine_ids": [machine],
                                            "start_ms": T0, "deadline_ms": None, "expected_duration_ms": None,
                                            "reason": "failed", "vacate": False}, "free", producer="health"))
    before = b.book.maintenance
    assert b.feed(ev("UnavailabilityEnded", {"unavailability_id": "ue-f", "machine_ids": [machine]}, "free",
                     producer="health")) == []
    assert b.book.maintenance == before


def test_quota_lent_and_not_yet_used_answers_the_demand_that_asked_for_it():
    """A borrower waiting for 1 task gets 1 machine of quota; until the allocator places the task (TasksAllocated
    clears the demand), the next ticks see the same demand: the lent quota it does not use yet answers it (it was
    lent again every tick, up to max_borrowed: 2 machines for 1 task in the browser test's region)."""
    b = lending(10, max_borrowed=4)
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 1))
    assert [e.payload["machines"] for e in b.tick(T0 + 1000) if e.type == "LoanGranted"] == [1]
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 1, ts=T0 + 1500))  # the scheduler asked again
    assert b.tick(T0 + 2000) == [], "the quota lent is not in use yet: it is what the task waits for"
    b.feed(rejected("batch", "batch.crunch", QUOTA_EXCEEDED, 3, ts=T0 + 2500))  # now 3 wait: 2 more
    assert [e.payload["machines"] for e in b.tick(T0 + 3000) if e.type == "LoanGranted"] == [2]
