"""The health check's heartbeat skim (streams/clients.SkimReader, issue 28 item 3) keeps what identities guarantee
(issue 27): on a table of heartbeats — good, malformed, unsigned, forged, another machine's, future-dated — the skim
gives what the ordinary decode gives (the same Beat), or declines a record the ordinary decode refuses (and that
decode, which the health check then runs, names the reason). Pure: records encoded and read in memory, no broker."""
import os
import time
from types import SimpleNamespace

import pytest

from processors.health import decide as d
from streams import auth
from streams.clients import SkimReader, proven_event
from streams.events import new_event
from streams.serde import INVALID_EVENT, DecodeError, SchemaRegistry
from streams.topics import Topics

REG = SchemaRegistry.from_dir()
CATALOGUE = Topics("t.", 4)
TOPIC = CATALOGUE.name("heartbeats")
MACHINE_SECRET, COMPONENT_SECRET = os.urandom(32), os.urandom(32)
NOW = int(time.time() * 1000)
M1, M2 = "dc1-r1-m001", "dc1-r1-m002"
MALFORMED = "malformed"  # any refusal of the decode itself (a truncated or garbled record)


def verifier():
    return auth.Verifier(machine_secret=MACHINE_SECRET, component_secret=COMPONENT_SECRET,
                         components=("health", "resourcebroker"))


def heartbeat(machine=M1, ts=NOW, sequence=7):
    return new_event("AgentHeartbeat", {"machine_id": machine, "running_task_ids": ["t1"], "sequence": sequence},
                     entitlement="", entity_id=machine, producer=f"agent/{machine}", timestamp_ms=ts)


def record(ev):
    return ev.to_record(REG.reader(ev.type).version)


def by_machine(ev, machine=None):
    """Sealed under the key of ``machine`` (default: the one the heartbeat names), as that machine's agent seals."""
    key = auth.machine_key(MACHINE_SECRET, machine or ev.payload["machine_id"])
    return auth.MachineSigner(lambda m: key).seal(REG, ev.type, record(ev))


def claiming(ev, identity, key_id=auth.HMAC_KEY_ID, prove=lambda m: os.urandom(32)):
    rec = record(ev)
    rec["envelope"]["auth"] = auth.auth_block(identity, key_id)
    return auth.seal(REG.encode(ev.type, rec), identity, key_id, prove)


def tampered(value):
    """A sealed heartbeat whose sequence (its last byte: a zig-zag varint under 64) is changed after sealing."""
    return value[:-1] + bytes((value[-1] + 2,))


class Msg:
    """A record as the broker hands it (confluent-kafka's Message accessors)."""

    def __init__(self, value, key):
        self._value, self._key = value, key

    def value(self):
        return self._value

    def key(self):
        return self._key

    def topic(self):
        return TOPIC


def full(v, msg):
    """The ordinary decode (EventConsumer._decode's steps): ('accepted', Beat, identity) or ('refused', reason)."""
    try:
        type_, data = REG.decode(msg.value())
        ev = proven_event(v, CATALOGUE, TOPIC, msg.key(), type_, data, msg.value())
    except DecodeError as exc:
        return ("refused", exc.reason if isinstance(exc, auth.AuthError) or exc.reason == INVALID_EVENT
                else MALFORMED)
    return ("accepted", d.beat_of(ev))


def skimmed(v, msg):
    reader = SkimReader(SimpleNamespace(registry=REG, verifier=v, catalogue=CATALOGUE), "heartbeats",
                        "AgentHeartbeat", d.BEAT_FIELDS)
    got = reader.read(msg)
    return None if got is None else ("accepted", d.Beat(*got))


GOOD = heartbeat()
SEALED = by_machine(GOOD)
AHEAD = heartbeat(ts=NOW + 86_400_000)
# name: (record value, record key, the ordinary decode's refusal reason, or None: accepted)
CASES = {
    "good": (SEALED, M1, None),
    "good, a day ahead (accepted here; the health check then refuses it: from_the_future)":
        (by_machine(AHEAD), M1, None),
    "malformed: truncated": (SEALED[:-3], M1, MALFORMED),
    "malformed: a byte past the end": (SEALED + b"\0", M1, MALFORMED),
    "malformed: empty": (b"", M1, MALFORMED),
    "unsigned": (REG.encode("AgentHeartbeat", record(GOOD)), M1, auth.UNSIGNED),
    "forged: a random proof claiming the machine": (claiming(GOOD, auth.machine_identity(M1)), M1, auth.BAD_PROOF),
    "forged: a day ahead, a random proof": (claiming(AHEAD, auth.machine_identity(M1)), M1, auth.BAD_PROOF),
    "forged: sequence changed after sealing": (tampered(SEALED), M1, auth.BAD_PROOF),
    "forged: sealed under another machine's key": (by_machine(GOOD, M2), M1, auth.BAD_PROOF),
    "another machine's: M2 proves a heartbeat naming M1":
        (claiming(GOOD, auth.machine_identity(M2),
                  prove=lambda m: auth.mac(auth.machine_key(MACHINE_SECRET, M2), m)), M1, auth.WRONG_IDENTITY),
    "another machine's key: M1's heartbeat keyed as M2": (SEALED, M2, INVALID_EVENT),
    "no record key": (SEALED, None, INVALID_EVENT),
    "an identity that is no component": (claiming(GOOD, "mallory"), M1, auth.WRONG_IDENTITY),
    "an unknown Ed25519 key id": (claiming(GOOD, auth.machine_identity(M1), key_id="k-1", prove=lambda m: b"s" * 64),
                                  M1, auth.UNVERIFIABLE),
}


@pytest.mark.parametrize("name", CASES)
def test_the_skim_gives_what_the_full_decode_gives(name):
    value, key, refused = CASES[name]
    msg = Msg(value, None if key is None else key.encode())
    v = verifier()
    ordinary = full(v, msg)
    if refused is None:
        assert ordinary[0] == "accepted", ordinary
        assert skimmed(v, msg) == ordinary
    else:
        assert ordinary == ("refused", refused)
        assert skimmed(v, msg) is None  # declined: the health check decodes it, which refuses it with that reason


def test_a_future_heartbeat_skimmed_is_from_the_future_as_decoded():
    value, key, _ = CASES["good, a day ahead (accepted here; the health check then refuses it: from_the_future)"]
    msg = Msg(value, key.encode())
    (_, beat), (_, decoded) = skimmed(verifier(), msg), full(verifier(), msg)
    assert d.from_the_future(beat, NOW) and d.from_the_future(decoded, NOW)
    assert not d.from_the_future(skimmed(verifier(), Msg(SEALED, M1.encode()))[1], NOW)


def test_without_keys_the_skim_checks_nothing_as_the_decode_checks_nothing():
    """A region without keys (no verifier): an unsigned heartbeat is read by both, a misplaced one refused by both."""
    unsigned = REG.encode("AgentHeartbeat", record(GOOD))
    ok = Msg(unsigned, M1.encode())
    assert skimmed(None, ok) == full(None, ok) == ("accepted", d.beat_of(GOOD))
    wrong_key = Msg(unsigned, M2.encode())
    assert full(None, wrong_key) == ("refused", INVALID_EVENT) and skimmed(None, wrong_key) is None


def test_the_skim_checks_what_the_verifier_reads():
    """``auth.checked_record`` of the skimmed fields holds what ``Verifier.check`` reads: on every sealed case, check of
    it gives what check of the whole decoded record gives (identity or reason)."""
    fields = auth.checked_fields("AgentHeartbeat")
    reader = SkimReader(SimpleNamespace(registry=REG, verifier=None, catalogue=CATALOGUE), "heartbeats",
                        "AgentHeartbeat", fields)
    v = verifier()
    for name, (value, key, refused) in CASES.items():
        if refused == MALFORMED or refused == INVALID_EVENT:
            continue
        values = reader.read(Msg(value, M1.encode()))
        assert values is not None, name

        def outcome(rec):
            try:
                return v.check("AgentHeartbeat", rec, value)
            except auth.AuthError as exc:
                return exc.reason
        assert outcome(auth.checked_record("AgentHeartbeat", values)) == outcome(REG.decode(value)[1]), name
