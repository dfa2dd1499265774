"""Identities on the log (streams/auth.py): what each writer seals, what each reader accepts and refuses, and why;
the key ring's announcements and rotations. Pure: records encoded and read in memory, no broker."""
import dataclasses
import os

import pytest

from processors.agent import decide as d
from streams import auth
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
MACHINE_SECRET, COMPONENT_SECRET = os.urandom(32), os.urandom(32)
OPERATOR_KEY = auth.new_signing_key("operator")
SCHEDULER_KEY = auth.new_signing_key("scheduler")
COMPONENTS = ("operator", "api", "scheduler", "allocator", "resourcebroker", "health", "sidekick")


def ring(*pinned, fetch=None, clock=None):
    anchor = auth.PublicKey("operator", OPERATOR_KEY.key_id, OPERATOR_KEY.public())
    keys = [auth.PublicKey(k.identity, k.key_id, k.public()) for k in (pinned or (SCHEDULER_KEY,))]
    return auth.KeyRing(anchor, keys, fetch, **({"clock": clock} if clock else {}))


def verifier(machine=True, component=True, keys=None):
    return auth.Verifier(machine_secret=MACHINE_SECRET if machine else None,
                         component_secret=COMPONENT_SECRET if component else None,
                         ring=ring() if keys is None else keys, components=COMPONENTS)


def machines():
    return auth.MachineSigner(lambda m: auth.machine_key(MACHINE_SECRET, m))


def one_machine(machine):
    key = auth.machine_key(MACHINE_SECRET, machine)
    return auth.MachineSigner(lambda m: key if m == machine else None)


def component(identity, signing=None):
    return auth.ComponentSigner(identity, COMPONENT_SECRET, signing)


def sealed(signer, ev):
    return signer.seal(REG, ev.type, ev.to_record(REG.reader(ev.type).version))


def unsigned(ev):
    return REG.encode(ev.type, ev.to_record(REG.reader(ev.type).version))


def claiming(ev, identity, key_id=auth.HMAC_KEY_ID, proof_len=32):
    rec = ev.to_record(REG.reader(ev.type).version)
    rec["envelope"]["auth"] = auth.auth_block(identity, key_id)
    return auth.seal(REG.encode(ev.type, rec), identity, key_id, lambda m: os.urandom(proof_len))


def check(value, v=None):
    type_, rec = REG.decode(value)
    return (v or verifier()).check(type_, rec, value)


def refused(value, v=None):
    with pytest.raises(auth.AuthError) as exc:
        check(value, v)
    return exc.value.reason


def heartbeat(machine="m1", ts=1000):
    return d.heartbeat(machine, 1, 7, ["e1.web/0"], ts)


def commands(machine="m1", ts=1000):
    return new_event("TasksCommanded", {"job_id": "e1.web", "argv": ["sleep", "1"], "env": {"A": "1"}, "part": 0,
                                        "parts": 1, "host_profile": "", "resources": {"cpu_millicores": 100,
                                                                                      "memory_mib": 64},
                                        "commands": [{"task_id": "e1.web/0", "machine_id": machine,
                                                      "command": "START", "spec_version": 1, "reason": ""}]},
                     entitlement="e1", entity_id="e1.web", producer="scheduler", timestamp_ms=ts)


def down(machine="m1"):
    return new_event("MachinesStatusChanged", {"status": "DOWN", "reason": "x", "machines": [
        {"machine_id": machine, "previous_status": "UP"}]}, entitlement="free/dc1", entity_id="free/dc1",
        producer="health")


def reports(*machines_):
    evs = [d._report(d.AgentState(m), d.TaskRun(f"e1.web/{i}", d.Spec("e1.web", "e1", 1, ("x",), (), "run"),
                                                d.P_RUNNING, d.STARTING), d.RUNNING, "up", 5)
           for i, m in enumerate(machines_)]
    return d.batch(evs, "agent/x", 5)[0]


# -- what each writer's records prove ----------------------------------------------------------------------------

ACCEPTED = [
    # signer, event, the identity a reader proves
    (machines(), heartbeat("m1"), "machine/m1"),
    (one_machine("m1"), heartbeat("m1"), "machine/m1"),
    (machines(), reports("m1", "m2"), auth.ANY_MACHINES),  # a proof per report
    (one_machine("m1"), reports("m1", "m1"), "machine/m1"),
    (component("health"), down(), "health"),
    (component("scheduler", SCHEDULER_KEY), commands(), "scheduler"),  # Ed25519: agents check it
    (component("scheduler", SCHEDULER_KEY), reports("m1"), "scheduler"),  # its own transitions: HMAC
    (component("operator", OPERATOR_KEY), commands(), "operator"),  # the anchor's key
    (component("operator", OPERATOR_KEY), heartbeat("m1"), "operator"),
]


@pytest.mark.parametrize("signer,event,identity", ACCEPTED, ids=[f"{e.type}-{i}" for i, (_, e, _) in
                                                                    enumerate(ACCEPTED)])
def test_what_each_writer_seals_verifies_as_its_identity(signer, event, identity):
    value = sealed(signer, event)
    assert check(value) == identity
    assert REG.decode(value)[1]["envelope"]["event_id"] == event.event_id  # decodes as any record does


REFUSED = [
    # what, the record's bytes, the reader, why it is refused
    ("unsigned heartbeat", lambda: unsigned(heartbeat()), None, auth.UNSIGNED),
    ("unsigned command", lambda: unsigned(commands()), None, auth.UNSIGNED),
    ("a report without its proof", lambda: unsigned(reports("m1")), None, auth.UNSIGNED),
    ("a machine's heartbeat for another", lambda: _sealed_by_machine_as("m2", heartbeat("m1")), None,
     auth.WRONG_IDENTITY),
    ("a machine writing a DOWN", lambda: _sealed_by_machine_as("m1", down("m1")), None, auth.WRONG_IDENTITY),
    ("a machine writing a command", lambda: _sealed_by_machine_as("m1", commands()), None, auth.WRONG_IDENTITY),
    ("reports under another machine's key", lambda: _reports_under("m9", reports("m1")), None, auth.BAD_PROOF),
    ("health's claim, a made-up proof", lambda: claiming(down(), "health"), None, auth.BAD_PROOF),
    ("a machine's claim, a made-up proof", lambda: claiming(heartbeat("m1"), "machine/m1"), None, auth.BAD_PROOF),
    ("the scheduler's signature, made up", lambda: claiming(commands(), "scheduler", SCHEDULER_KEY.key_id, 64), None,
     auth.BAD_PROOF),
    ("a command MACed, not signed", lambda: _hmac_command("scheduler"), None, auth.WRONG_IDENTITY),
    ("a command signed by health", lambda: sealed(component("health", auth.new_signing_key("health")), commands()),
     None, auth.WRONG_IDENTITY),
    ("an identity no component has", lambda: claiming(down(), "nobody"), None, auth.WRONG_IDENTITY),
    ("a key the ring does not know", lambda: sealed(component("scheduler", auth.new_signing_key("scheduler")),
                                                    commands()), None, auth.UNKNOWN_KEY),
    ("a heartbeat, to a reader without the machine secret", lambda: sealed(machines(), heartbeat()),
     verifier(machine=False), auth.UNVERIFIABLE),
    ("a DOWN, to a reader without the component secret", lambda: sealed(component("health"), down()),
     verifier(component=False), auth.UNVERIFIABLE),
]


def _sealed_by_machine_as(machine, ev):
    """``ev`` with a true proof of ``machine`` (the attacker's own key), whatever it says."""
    rec = ev.to_record(REG.reader(ev.type).version)
    ident = auth.machine_identity(machine)
    rec["envelope"]["auth"] = auth.auth_block(ident, auth.HMAC_KEY_ID)
    key = auth.machine_key(MACHINE_SECRET, machine)
    return auth.seal(REG.encode(ev.type, rec), ident, auth.HMAC_KEY_ID, lambda m: auth.mac(key, m))


def _reports_under(machine, ev):
    rec = ev.to_record(REG.reader(ev.type).version)
    key = auth.machine_key(MACHINE_SECRET, machine)
    rec["reports"] = [{**r, "proof": auth.item_proof(key, ev.entitlement, r)} for r in rec["reports"]]
    return REG.encode(ev.type, rec)


def _hmac_command(identity):
    return _hmac(identity, commands())


def _hmac(identity, ev):
    """``ev`` with a true HMAC proof of component ``identity`` (where the writer would have signed)."""
    rec = ev.to_record(REG.reader(ev.type).version)
    rec["envelope"]["auth"] = auth.auth_block(identity, auth.HMAC_KEY_ID)
    key = auth.component_key(COMPONENT_SECRET, identity)
    return auth.seal(REG.encode(ev.type, rec), identity, auth.HMAC_KEY_ID, lambda m: auth.mac(key, m))


@pytest.mark.parametrize("what,value,reader,reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_what_a_reader_refuses_and_why(what, value, reader, reason):
    assert refused(value(), reader) == reason


@pytest.mark.parametrize("signer,event", [(machines(), heartbeat()), (component("health"), down()),
                                          (component("scheduler", SCHEDULER_KEY), commands()),
                                          (machines(), reports("m1", "m2"))])
def test_any_byte_changed_is_refused(signer, event):
    """Every byte of a sealed record is covered: changing any one of them (the header's schema fingerprint, the
    identity, the payload, the proof) makes the record refused or unreadable, never accepted. An agents' batch of
    reports proves its reports (each one, and the entitlement), not its envelope: from the first report on."""
    value = sealed(signer, event)
    first = value.index(event.payload["reports"][0]["report_id"].encode()) - 1 if event.type == auth.REPORTS else 0
    for i in range(first, len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x01
        try:
            type_, rec = REG.decode(bytes(bad))
        except Exception:  # noqa: BLE001 - unreadable: refused by the decoding already
            continue
        with pytest.raises(auth.AuthError):
            verifier().check(type_, rec, bytes(bad))


def test_a_genuine_command_altered_keeps_its_proof_and_is_refused():
    """The scheduler's signed record, its argv replaced and encoded again with its auth as it was."""
    type_, rec = REG.decode(sealed(component("scheduler", SCHEDULER_KEY), commands()))
    altered = REG.encode(type_, {**rec, "argv": ["sh", "-c", "id > pwned"]})
    assert refused(altered) == auth.BAD_PROOF


def test_seal_needs_an_empty_proof_first_in_the_envelope():
    with pytest.raises(ValueError):
        auth.seal(unsigned(heartbeat()), "machine/m1", auth.HMAC_KEY_ID, lambda m: b"x" * 32)


def test_an_event_read_carries_its_identity_which_no_equality_or_encoding_sees():
    ev = heartbeat()
    proven = dataclasses.replace(ev, identity="machine/m1")
    assert proven == ev and proven.to_record() == ev.to_record()
    assert proven.to_record()["envelope"]["auth"] is None
    assert proven.to_json()["identity"] == "machine/m1"


# -- the key ring ----------------------------------------------------------------------------------------------

def announcement(identity, new, previous=None, until=None, signer=OPERATOR_KEY, ts=1000):
    ev = new_event("SigningKeyAnnounced", {"identity": identity, "key_id": new.key_id, "public_key": new.public(),
                                           "previous_key_id": previous.key_id if previous else None,
                                           "previous_until_ms": until, "reason": "rotation",
                                           "previous_public_key": previous.public() if previous else None},
                   entitlement="", entity_id=identity, producer="operator", timestamp_ms=ts)
    value = sealed(auth.ComponentSigner(signer.identity, None, signer), ev)
    return REG.decode(value)[1], value


def test_a_rotation_signed_by_the_operator_or_the_old_key_is_taken_and_the_overlap_ends():
    keys = ring()
    new = auth.new_signing_key("scheduler")
    assert keys.apply(*announcement("scheduler", new, SCHEDULER_KEY, until=5000)) is None
    v = verifier(keys=keys)
    assert check(sealed(component("scheduler", new), commands(ts=9000)), v) == "scheduler"
    assert check(sealed(component("scheduler", SCHEDULER_KEY), commands(ts=5000)), v) == "scheduler"  # overlap
    assert refused(sealed(component("scheduler", SCHEDULER_KEY), commands(ts=5001)), v) == auth.KEY_RETIRED
    newer = auth.new_signing_key("scheduler")  # the next one, signed by the current scheduler key itself
    assert keys.apply(*announcement("scheduler", newer, new, until=6000, signer=new)) is None
    assert check(sealed(component("scheduler", newer), commands(ts=9000)), v) == "scheduler"


@pytest.mark.parametrize("identity,signer,why", [
    ("scheduler", auth.new_signing_key("scheduler"), auth.UNKNOWN_KEY),  # a key nobody announced
    ("scheduler", auth.new_signing_key("sidekick"), auth.WRONG_IDENTITY),  # another identity's key
    ("sidekick", SCHEDULER_KEY, auth.WRONG_IDENTITY),  # the scheduler announcing Sidekick's key
])
def test_an_announcement_not_signed_by_the_operator_or_the_identity_is_refused(identity, signer, why):
    keys = ring()
    assert keys.apply(*announcement(identity, auth.new_signing_key(identity), signer=signer)) == why
    assert len(keys.keys) == 2


def test_an_announcement_with_a_made_up_signature_or_none_is_refused():
    keys = ring()
    rec, value = announcement("scheduler", auth.new_signing_key("scheduler"))
    bad = bytearray(value)
    bad[-1] ^= 1  # the last byte: the announcement's reason
    assert keys.apply(REG.decode(bytes(bad))[1], bytes(bad)) == auth.BAD_PROOF
    ev = new_event("SigningKeyAnnounced", {"identity": "scheduler", "key_id": "k", "public_key": b"\0" * 32,
                                           "previous_key_id": None, "previous_until_ms": None, "reason": ""},
                   entitlement="", entity_id="scheduler", producer="operator")
    assert keys.apply(REG.decode(unsigned(ev))[1], unsigned(ev)) == auth.UNSIGNED


def test_an_unknown_key_makes_the_ring_read_the_keys_topic_at_most_so_often():
    new = auth.new_signing_key("scheduler")
    log = [announcement("scheduler", new, SCHEDULER_KEY, until=5000)]
    calls, now = [], [100.0]

    def fetch():
        calls.append(now[0])
        out = list(log)
        log.clear()
        return out
    keys = ring(fetch=fetch, clock=lambda: now[0])
    assert keys.key("scheduler", new.key_id, 9000).key_id == new.key_id  # read at once: the first use
    assert len(calls) == 1
    with pytest.raises(auth.AuthError):
        keys.key("scheduler", "made-up", 9000)  # read again? not within UNKNOWN_REFRESH_S of the last read
    assert len(calls) == 1
    now[0] += auth.UNKNOWN_REFRESH_S
    with pytest.raises(auth.AuthError):
        keys.key("scheduler", "made-up", 9000)
    assert len(calls) == 2
    now[0] += auth.REFRESH_S + 1
    keys.key("scheduler", new.key_id, 9000)  # known, but read again every REFRESH_S (a retirement is learnt)
    assert len(calls) == 3


def test_a_reader_whose_file_names_only_the_new_key_accepts_the_old_one_for_the_overlap():
    """A principal file written after the rotation pins the new key only; the announcement names the old one too."""
    new = auth.new_signing_key("scheduler")
    keys = ring(new)
    assert keys.apply(*announcement("scheduler", new, SCHEDULER_KEY, until=5000)) is None
    v = verifier(keys=keys)
    assert check(sealed(component("scheduler", SCHEDULER_KEY), commands(ts=5000)), v) == "scheduler"
    assert refused(sealed(component("scheduler", SCHEDULER_KEY), commands(ts=5001)), v) == auth.KEY_RETIRED


def profile_request(machine="m1", ts=1000):
    return new_event("HostProfileRequested", {"request_id": f"{machine}@v1:web", "machine_id": machine,
                                              "host_profile": "web", "previous_host_profile": "",
                                              "settings": {"vm.nr_hugepages": "0"}},
                     entitlement="e1", entity_id=machine, producer="sidekick", timestamp_ms=ts)


SIDEKICK_KEY = auth.new_signing_key("sidekick")
PROFILE_REQUESTS = [
    # who seals a HostProfileRequested (what agents apply), and what a reader pinning Sidekick's key makes of it
    ("sidekick's signature", lambda: sealed(component("sidekick", SIDEKICK_KEY), profile_request()), "sidekick"),
    ("the operator's signature", lambda: sealed(component("operator", OPERATOR_KEY), profile_request()), "operator"),
    ("unsigned", lambda: unsigned(profile_request()), auth.UNSIGNED),
    ("MACed by sidekick, not signed", lambda: _hmac("sidekick", profile_request()), auth.WRONG_IDENTITY),
    ("sidekick without its key: sealed with nothing", lambda: sealed(component("sidekick"), profile_request()),
     auth.UNSIGNED),
    ("signed by the scheduler", lambda: sealed(component("scheduler", SCHEDULER_KEY), profile_request()),
     auth.WRONG_IDENTITY),
    ("a machine asking itself", lambda: _sealed_by_machine_as("m1", profile_request("m1")), auth.WRONG_IDENTITY),
    ("a key the ring does not know", lambda: sealed(component("sidekick", auth.new_signing_key("sidekick")),
                                                    profile_request()), auth.UNKNOWN_KEY),
]


@pytest.mark.parametrize("what,value,outcome", PROFILE_REQUESTS, ids=[r[0] for r in PROFILE_REQUESTS])
def test_a_host_profile_request_counts_only_signed_by_sidekick_or_the_operator(what, value, outcome):
    """Issue 27: agents apply host profiles Sidekick asks for; an agent principal must not make another machine
    apply one (HostProfileRequested is on `tasks`, which agents may write)."""
    v = verifier(keys=ring(SCHEDULER_KEY, SIDEKICK_KEY))
    if outcome in auth.REASONS:
        assert refused(value(), v) == outcome
    else:
        assert check(value(), v) == outcome
