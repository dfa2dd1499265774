"""streams/skim.py: the skimmer reads what the full decode reads, and declines (None) whatever the full decode
refuses — checked on a table of heartbeats and on seeded random corruptions of their bytes."""
import random

import pytest

from streams.events import new_event
from streams.serde import DecodeError, SchemaRegistry
from streams.skim import Skimmer

REGISTRY = SchemaRegistry.from_dir()
FIELDS = ("envelope.event_id", "envelope.timestamp_ms", "machine_id", "sequence", "envelope.causation_id")


def heartbeat(machine_id="dc1-msb1-r01-m001", tasks=("t1", "t2"), sequence=7, causation=None, ts=1_795_000_000_123):
    return REGISTRY.encode("AgentHeartbeat", {
        "envelope": {"event_id": "e-1", "entitlement": "", "entity_id": machine_id, "producer": f"agent/{machine_id}",
                     "causation_id": causation, "timestamp_ms": ts, "schema_version": 1, "principal": None},
        "machine_id": machine_id, "running_task_ids": list(tasks), "sequence": sequence})


def full(value: bytes) -> tuple | None:
    """The same fields by the ordinary decode, None when it refuses the record."""
    try:
        type_, data = REGISTRY.decode(value)
    except DecodeError:
        return None
    if type_ != "AgentHeartbeat":
        return None
    env = data["envelope"]
    return env["event_id"], env["timestamp_ms"], data["machine_id"], data["sequence"], env["causation_id"]


HEARTBEATS = {
    "plain": heartbeat(),
    "no-tasks": heartbeat(tasks=()),
    "many-tasks": heartbeat(tasks=[f"task-{i}" for i in range(300)]),
    "unicode-id": heartbeat(machine_id="dc1-mé-ü"),
    "negative-and-huge-numbers": heartbeat(sequence=-5, ts=2**62),
    "a-causation": heartbeat(causation="c-9"),
}


@pytest.mark.parametrize("value", HEARTBEATS.values(), ids=HEARTBEATS.keys())
def test_the_skimmer_reads_what_the_full_decode_reads(value):
    skim = Skimmer(REGISTRY, "AgentHeartbeat", FIELDS)
    assert skim(value) == full(value) is not None


def _other_event() -> bytes:
    ev = new_event("MachineStatusChanged", {"machine_id": "m", "status": "UP", "previous_status": "DOWN",
                                            "reason": "operator"}, entitlement="free/dc1", entity_id="m",
                   producer="resourcebroker", timestamp_ms=1)
    return REGISTRY.encode(ev.type, ev.to_record())


DECLINED = {
    "none": None,
    "empty": b"",
    "truncated": HEARTBEATS["plain"][:-1],
    "a-trailing-byte": HEARTBEATS["plain"] + b"\x00",
    "no-marker": b"\x00\x01" + HEARTBEATS["plain"][2:],
    "an-unknown-fingerprint": HEARTBEATS["plain"][:2] + b"\xff" * 8 + HEARTBEATS["plain"][10:],
    "a-string-that-is-no-utf8": HEARTBEATS["plain"].replace(b"dc1-msb1-r01-m001", b"dc1-msb1-r01-m\xff\xfe1", 1),
}


@pytest.mark.parametrize("value", DECLINED.values(), ids=DECLINED.keys())
def test_the_skimmer_declines_what_the_full_decode_refuses(value):
    assert Skimmer(REGISTRY, "AgentHeartbeat", FIELDS)(value) is None
    assert value is None or full(value) is None


def test_a_record_of_another_type_is_declined():
    other = _other_event()
    assert full(other) is None and REGISTRY.decode(other)[0] == "MachineStatusChanged"
    assert Skimmer(REGISTRY, "AgentHeartbeat", FIELDS)(other) is None


@pytest.mark.parametrize("seed", range(6))
def test_corrupted_bytes_are_read_as_the_full_decode_reads_them_or_declined(seed):
    """An adversary's bytes: whatever the skimmer returns, the full decode returns too; never an exception."""
    rng = random.Random(seed)
    skim = Skimmer(REGISTRY, "AgentHeartbeat", FIELDS)
    base = list(HEARTBEATS.values())
    declined = 0
    for _ in range(400):
        b = bytearray(rng.choice(base))
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(10, len(b))  # past the header: the body is what the skimmer walks
            b[i] = rng.randrange(256)
        got = skim(bytes(b))
        if got is None:
            declined += 1
        else:
            assert got == full(bytes(b))
    assert 0 < declined < 400  # some corruptions still read, others do not: the check saw both


def test_fields_it_cannot_read_are_refused_when_it_is_made():
    with pytest.raises(ValueError, match="no field"):
        Skimmer(REGISTRY, "AgentHeartbeat", ("machine_idd",))
    with pytest.raises(ValueError, match="name its fields"):
        Skimmer(REGISTRY, "AgentHeartbeat", ("envelope",))
    with pytest.raises(ValueError, match="cannot be skimmed"):
        Skimmer(REGISTRY, "AgentHeartbeat", ("running_task_ids",))
