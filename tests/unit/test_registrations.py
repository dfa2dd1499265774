"""A region's registration as MachinesRegistered records (a thousand machines each), read by every reader of the
``machines`` topic as the MachineRegistered per machine an older log holds: the Resource Broker's fold, the
allocator's, the health check's and the lender's come out the same from either form."""
import pytest

from processors.allocator.fold import RegionFold
from processors.health import decide as health
from processors.resourcebroker import decide as rb
from processors.resourcebroker import loans
from processors.resourcebroker.region import MachineSpec, generate_region, iter_machines
from streams import batches
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000
REGION = list(iter_machines(generate_region(2_500, 2, 0)))  # two DCs: 1,250 machines each


def one_per_machine(events):
    """``events`` as a log written before MachinesRegistered: a MachineRegistered per machine, same key and time."""
    return [new_event("MachineRegistered", dict(reg), entitlement=ev.entitlement, entity_id=reg["machine_id"],
                      producer=ev.producer, timestamp_ms=ev.timestamp_ms, event_id=f"{ev.event_id}/{reg['machine_id']}")
            for ev in events for reg in batches.machine_registrations(ev)]


def test_a_region_registers_a_record_per_owner_key_and_thousand_machines_each_valid():
    state, events = rb.register_all(rb.BrokerState(), REGION, T0)
    assert [(e.type, e.entitlement, len(e.payload["machines"])) for e in events] == [
        ("MachinesRegistered", "free/dc1", 1000), ("MachinesRegistered", "free/dc1", 250),
        ("MachinesRegistered", "free/dc2", 1000), ("MachinesRegistered", "free/dc2", 250)]
    assert [r["machine_id"] for e in events for r in batches.machine_registrations(e)] == [m.id for m in REGION]
    for e in events:  # each record encodes (the schema's own check) and stays far below the broker's limit
        assert len(REG.encode(e.type, e.to_record(1))) < batches.MAX_RECORD_BYTES // 5
    assert len(state) == len(REGION)
    assert [e.event_id for e in rb.register_all(rb.BrokerState(), REGION, T0)[1]] == [e.event_id for e in events]
    assert len({e.event_id for e in events}) == 4
    assert rb.register_all(state, REGION, T0 + 1) == (state, [])  # registered: nothing again


def test_a_machine_listed_twice_is_registered_as_its_last_listing():
    m = REGION[0]
    bigger = m._replace(cpu_millicores=m.cpu_millicores * 2)
    state, events = rb.register_all(rb.BrokerState(), [m, m, bigger], T0)
    assert [r["capacity"]["cpu_millicores"] for r in batches.machine_registrations(events[0])] == [
        m.cpu_millicores, 2 * m.cpu_millicores]
    assert state.get(m.id).cpu_millicores == 2 * m.cpu_millicores
    with pytest.raises(rb.RegistrationConflict):
        rb.register_all(rb.BrokerState(), [m, m._replace(rack="elsewhere")], T0)


def _broker(events):
    return dict(rb.apply_all(rb.BrokerState(), events).machines.items())


def _allocator(events):
    fold = RegionFold()
    for i, e in enumerate(events):
        fold.apply(e, ("machines", 0, i))
    return sorted(fold.machine_rows()), dict(fold.statuses), set(fold.changed)


def _health(events):
    state = health.apply_all(health.HealthState(), events)
    return dict(state.machines.items()), state.zone_sizes


def _lender(events):
    book = loans.LoanBook()
    for e in events:
        book, out = loans.apply(book, e)
        assert out == []
    return dict(book.broker.machines.items())


# reader -> (its fold of a log, whether it holds a machine's capacity: the health check watches machines, no more)
READERS = {"resource broker": (_broker, True), "allocator": (_allocator, True), "health check": (_health, False),
           "lender": (_lender, True)}


@pytest.mark.parametrize("read, holds_capacity", READERS.values(), ids=READERS.keys())
def test_every_reader_folds_a_batched_registration_as_one_event_per_machine(read, holds_capacity):
    state, events = rb.register_all(rb.BrokerState(), REGION, T0)
    assert read(events) == read(one_per_machine(events))
    # a re-registration (a machine's capacity changed) in either form, after either form
    changed = [REGION[3]._replace(memory_mib=REGION[3].memory_mib * 2)]
    _, again = rb.register_all(state, changed, T0 + 5)
    assert read(events + again) == read(one_per_machine(events + again))
    assert (read(events + again) != read(events)) is holds_capacity
    assert read(events + events) == read(events)  # delivered twice: nothing more


def test_the_replay_filter_and_the_lender_name_every_machine_of_a_batch():
    _, events = rb.register_all(rb.BrokerState(), REGION[:3], T0)
    assert batches.machine_ids(events[0]) == [m.id for m in REGION[:3]]
    assert batches.machine_registrations(new_event("MachineStatusChanged", {}, entitlement="e", entity_id="m",
                                                   producer="p")) == []


def test_one_machine_registered_is_a_batch_of_one():
    m = MachineSpec("dc1-msb1-r01-m001", "r1", "dc1", "msb1", "r01", "skylake", 32000, 131072)
    _, events = rb.register(rb.BrokerState(), m, T0)
    assert [(e.type, e.entitlement, batches.machine_ids(e)) for e in events] == [
        ("MachinesRegistered", "free/dc1", [m.id])]
