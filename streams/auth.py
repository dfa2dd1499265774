"""Who wrote a record, proven (issue 27): every record on a topic an agent may write carries its writer's identity and
a proof of it in its envelope (``auth``), and every reader refuses a record there whose proof does not verify.

The broker's ACLs say which *principal* may write a topic (``infra/acls.py``), and every machine's agent is one
principal, ``agent``, which may write ``tasks``, ``machines`` and ``heartbeats``: without proofs, one machine could
forge the scheduler's commands to another, its reports, the health check's verdicts, a registration. So:

* **Identities.** A component is its principal's name (``scheduler``, ``health``, ``resourcebroker``, ``api``,
  ``operator``, ...); a machine is ``machine/<id>``.
* **Machines: HMAC-SHA256** under the machine's own key, ``machine_key(machine secret, id)``. Only the machine holds
  its key (``<secrets>/machines/<id>.json``, infra/trust.py); the verifiers (the control plane's principals) hold the
  region's machine secret and derive any machine's key. A machine may speak only of itself (``MACHINE_SPEECH``: its
  heartbeats, its task reports, its refusals, its host-profile answers), each naming its own machine.
* **Components: HMAC-SHA256** under ``component_key(component secret, identity)``, a secret the control plane's
  principals hold and the agents do not: an agent cannot pass for ``health`` or ``scheduler``. (A control-plane
  principal could pass for another: they hold the same secret; the line drawn is between the machines and the
  control plane, and between one machine and another.) Why HMAC and not a signature: a verification costs ~1 µs
  against ~50 µs for Ed25519 (``ropewalk bench``, "identities"), and the health check verifies every heartbeat.
* **Commands: Ed25519.** What the agents act on (``COMMANDED``: the scheduler's task commands, Sidekick's host-profile
  requests) must be verifiable by agents, which must not be able to make it: those records are signed with the
  commander's Ed25519 key. Agents know the public keys from their principal's file (pinned when the operator wrote
  it) and from the ``keys`` topic (``SigningKeyAnnounced``: a rotation, signed by the operator's key, which every
  file pins, or by the identity's previous key), through a ``KeyRing``.

**The wire.** ``auth`` is the envelope's first field, so its bytes follow the 10-byte header at once: the union index
(1 byte), ``identity``, ``key_id``, then ``proof``. A writer encodes the record with an empty proof, proves the bytes
without the proof's length byte, and puts the proof in (``seal``); a reader cuts the proof's bytes out of the record
it read (``message``) and checks them: nothing is encoded again, and the proof covers every other byte of the record,
the schema fingerprint included. A TaskStatesChanged of an agent holds reports of many machines (a simulated agents'
process batches them): each report carries its own ``proof`` (``item_proof``) and the envelope none.

Decisions never see any of this: ``Event.identity`` is what a reader verified (None where nothing is proven), and
the producers seal what the pure code decided (``streams/clients.EventProducer``), so replaying and shadowing the
scheduler (processors/history) decide the same events without any key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Sequence

from streams.serde import HEADER_LEN, DecodeError

# cryptography is imported inside the Ed25519 code (~10 ms, measured with -X importtime): every reader and writer
# imports this module (streams/clients.py) and most only ever compute HMACs.

OPERATOR = "operator"
HMAC_KEY_ID = "hmac"  # auth.key_id of an HMAC proof; any other key id names an Ed25519 key
MACHINE_PREFIX = "machine/"
ANY_MACHINES = MACHINE_PREFIX + "*"  # the identity of a batch whose reports each prove their own machine
# The data topics the agent principal may write (infra/acls.py) whose readers act on what they read: every record on
# them carries a proof. (An agent also writes `metrics`, `deadletter` and `_schemas`: README, "What is still open".)
AUTHENTICATED = frozenset({"tasks", "machines", "heartbeats"})
SEALED = AUTHENTICATED | {"keys"}  # what producers seal: those, and the keys' announcements (checked by the KeyRing)
# Records agents act on: signed (Ed25519) by one of these identities, or by the operator.
COMMANDED: Mapping[str, frozenset[str]] = MappingProxyType({
    "TasksCommanded": frozenset({"scheduler"}), "TaskCommanded": frozenset({"scheduler"}),
    "HostProfileRequested": frozenset({"sidekick"})})
# Sealed with an Ed25519 signature (by a signer that has a key): what agents act on, and the keys' announcements.
SIGNED = frozenset({*COMMANDED, "SigningKeyAnnounced"})
ITEMS = "reports"  # MACHINE_SPEECH of a batch: every report names a machine
# What a machine may write, and the payload field naming the machine it speaks of.
MACHINE_SPEECH: Mapping[str, str] = MappingProxyType({
    "AgentHeartbeat": "machine_id", "TaskStateChanged": "machine_id", "TaskCommandRefused": "machine_id",
    "HostProfileApplied": "machine_id", "HostProfileFailed": "machine_id", "TaskStatesChanged": ITEMS})
REPORTS = "TaskStatesChanged"

# Why a record's proof was refused (DeadLetterRecorded.reason, TaskCommandRefused.reason).
UNSIGNED = "unsigned"  # no auth (or a report without its proof) on an authenticated topic
BAD_PROOF = "bad_proof"  # the MAC or signature does not verify
UNKNOWN_KEY = "unknown_key"  # an Ed25519 key id the reader's ring does not know for that identity
KEY_RETIRED = "key_retired"  # signed with a key whose overlap ended before the record's time
WRONG_IDENTITY = "wrong_identity"  # the identity may not write this record (a machine speaking of another, ...)
UNVERIFIABLE = "unverifiable"  # this reader holds no secret to check such an identity (an agent reading a report)
MALFORMED_AUTH = "malformed_auth"  # the auth block is not where and what the format says
REASONS = (UNSIGNED, BAD_PROOF, UNKNOWN_KEY, KEY_RETIRED, WRONG_IDENTITY, UNVERIFIABLE, MALFORMED_AUTH)

UNKNOWN_REFRESH_S = 0.2  # an unknown key id makes the ring read the keys topic again, at most this often
REFRESH_S = 60.0  # and it reads it at least this often while used (a rotation's overlap ends: learned in time)


class AuthError(DecodeError):
    """A record whose proof a reader refuses; ``reason`` is one of ``REASONS``."""


def machine_identity(machine_id: str) -> str:
    return MACHINE_PREFIX + machine_id


def machine_of(identity: str | None) -> str | None:
    """The machine id of a machine identity, else None."""
    return identity[len(MACHINE_PREFIX):] if identity and identity.startswith(MACHINE_PREFIX) else None


def machine_key(secret: bytes, machine_id: str) -> bytes:
    """A machine's own key, derived from the region's machine secret."""
    return hmac.digest(secret, b"machine\0" + machine_id.encode(), "sha256")


def component_key(secret: bytes, identity: str) -> bytes:
    """A component's key, derived from the control plane's secret."""
    return hmac.digest(secret, b"component\0" + identity.encode(), "sha256")


def mac(key: bytes, message: bytes) -> bytes:
    return hmac.digest(key, message, "sha256")


# -- the wire ---------------------------------------------------------------------------------------------------

def _long(n: int) -> bytes:
    """Avro's zig-zag varint of a non-negative ``n`` (a length)."""
    if n < 64:
        return _SMALL[n]
    n <<= 1
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL = tuple(bytes((n << 1,)) for n in range(64))


def _encoded_len(raw: bytes) -> int:
    n = len(raw)
    return (1 if n < 64 else len(_long(n))) + n


def proof_offset(identity: str, key_id: str) -> int:
    """Where the proof's length prefix is in a record whose auth names ``identity`` and ``key_id``."""
    return HEADER_LEN + 1 + _encoded_len(identity.encode()) + _encoded_len(key_id.encode())


def auth_block(identity: str, key_id: str) -> dict:
    """The envelope's ``auth`` before sealing (an empty proof)."""
    return {"identity": identity, "key_id": key_id, "proof": b""}


def seal(data: bytes, identity: str, key_id: str, prove: Callable[[bytes], bytes]) -> bytes:
    """``data``, encoded with ``auth_block(identity, key_id)``, with its proof in: ``prove`` of the bytes without the
    empty proof's one length byte."""
    at = proof_offset(identity, key_id)
    if data[HEADER_LEN] != 2 or data[at] != 0:
        raise ValueError("the record was not encoded with an empty auth proof first in its envelope")
    proof = prove(data[:at] + data[at + 1:])
    return data[:at] + _long(len(proof)) + proof + data[at + 1:]


def message(value: bytes, identity: str, key_id: str, proof: bytes) -> bytes:
    """What ``proof`` proves in a record read as ``value``: its bytes without the proof. AuthError if the proof is
    not where its identity and key id say (a writer schema without ``auth`` first: no Ropewalk writer)."""
    at = proof_offset(identity, key_id)
    prefix = _long(len(proof))
    end = at + len(prefix) + len(proof)
    if value[HEADER_LEN:HEADER_LEN + 1] != b"\x02" or value[at:end] != prefix + proof:
        raise AuthError(MALFORMED_AUTH, "the auth block is not first in the envelope")
    return value[:at] + value[end:]


def item_message(entitlement: str, item: Mapping[str, Any]) -> bytes:
    """What a report's proof proves: the report's fields and the batch's entitlement, as JSON (unambiguous)."""
    return json.dumps([entitlement, item["report_id"], item["task_id"], item["job_id"], item.get("machine_id"),
                       item["state"], item["previous_state"], item.get("exit_code"), item.get("spec_version", 1),
                       item.get("reason", ""), item.get("cause_id")], separators=(",", ":")).encode()


def item_proof(key: bytes, entitlement: str, item: Mapping[str, Any]) -> bytes:
    return mac(key, item_message(entitlement, item))


# -- keys -------------------------------------------------------------------------------------------------------

def key_id_of(identity: str, public: bytes) -> str:
    """A public key's id: its identity and the first 8 hex digits of its SHA-256."""
    return f"{identity}-{hashlib.sha256(public).hexdigest()[:8]}"


@dataclass
class PublicKey:
    """One Ed25519 public key of an identity, and until when records signed with it are accepted."""

    identity: str
    key_id: str
    raw: bytes
    until_ms: int | None = None  # records dated after this are refused (the overlap of a rotation ended)
    _key: Any = field(default=None, repr=False, compare=False)

    def verify(self, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if self._key is None:
            self._key = Ed25519PublicKey.from_public_bytes(self.raw)
        try:
            self._key.verify(signature, data)
            return True
        except InvalidSignature:
            return False


@dataclass
class SigningKey:
    """One identity's Ed25519 private key (raw 32 bytes) and its key id."""

    identity: str
    key_id: str
    raw: bytes
    _key: Any = field(default=None, repr=False, compare=False)

    def sign(self, data: bytes) -> bytes:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        if self._key is None:
            self._key = Ed25519PrivateKey.from_private_bytes(self.raw)
        return self._key.sign(data)

    def public(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self.sign(b"")  # loads the key
        return self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def new_signing_key(identity: str) -> SigningKey:
    """A fresh Ed25519 key for ``identity``."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    probe = SigningKey(identity, "", raw)
    return SigningKey(identity, key_id_of(identity, probe.public()), raw)


class KeyRing:
    """The Ed25519 public keys a reader accepts: the operator's (the anchor, pinned), those pinned in its principal's
    file, and those the ``keys`` topic announces (``apply``). ``fetch`` (the wiring's: ``infra.trust.log_keys``)
    returns the announcements written since its last call as ``(record, value)`` pairs; the ring calls it when it
    meets a key id it does not know (at most every ``UNKNOWN_REFRESH_S``) and every ``REFRESH_S`` while used."""

    def __init__(self, anchor: PublicKey, pinned: Iterable[PublicKey] = (),
                 fetch: Callable[[], Iterable[tuple[dict, bytes]]] | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.anchor = anchor
        self.keys: dict[tuple[str, str], PublicKey] = {(anchor.identity, anchor.key_id): anchor}
        for k in pinned:
            self.keys[(k.identity, k.key_id)] = k
        self.fetch = fetch
        self.clock = clock
        self._fetched_at = float("-inf")
        self.refused: list[tuple[dict, str]] = []  # announcements that did not verify, with why (for the logs)

    def key(self, identity: str, key_id: str, at_ms: int) -> PublicKey:
        """The key records of ``identity`` dated ``at_ms`` are checked with; AuthError if there is none."""
        now = self.clock()
        if self.fetch is not None and now - self._fetched_at >= REFRESH_S:
            self.refresh()
        if (identity, key_id) not in self.keys and self.fetch is not None and now - self._fetched_at >= UNKNOWN_REFRESH_S:
            self.refresh()
        return self._held(identity, key_id, at_ms)

    def _held(self, identity: str, key_id: str, at_ms: int) -> PublicKey:
        k = self.keys.get((identity, key_id))
        if k is None:
            raise AuthError(UNKNOWN_KEY, f"no key {key_id!r} of {identity!r} is pinned or announced")
        if k.until_ms is not None and at_ms > k.until_ms:
            raise AuthError(KEY_RETIRED, f"key {key_id!r} of {identity!r} is accepted for records up to "
                                         f"{k.until_ms}; this one is dated {at_ms}")
        return k

    def refresh(self) -> None:
        self._fetched_at = self.clock()
        if self.fetch is None:
            return
        for record, value in self.fetch():
            why = self.apply(record, value)
            if why is not None:
                self.refused.append((record, why))

    def apply(self, record: Mapping[str, Any], value: bytes) -> str | None:
        """Take one SigningKeyAnnounced (decoded ``record``, its bytes ``value``); None if taken, else why not."""
        auth = record["envelope"].get("auth")
        if auth is None:
            return UNSIGNED
        who, kid = auth["identity"], auth["key_id"]
        if who not in (OPERATOR, record["identity"]):
            return WRONG_IDENTITY
        try:
            signer = self._held(who, kid, record["envelope"]["timestamp_ms"])
            if not signer.verify(auth["proof"], message(value, who, kid, auth["proof"])):
                return BAD_PROOF
        except AuthError as exc:
            return exc.reason
        new = PublicKey(record["identity"], record["key_id"], bytes(record["public_key"]))
        self.keys.setdefault((new.identity, new.key_id), new)
        if record.get("previous_key_id") and record.get("previous_public_key"):  # a file that pins only the new one
            self.keys.setdefault((new.identity, record["previous_key_id"]),
                                 PublicKey(new.identity, record["previous_key_id"], bytes(record["previous_public_key"])))
        prev = self.keys.get((new.identity, record.get("previous_key_id") or ""))
        if prev is not None and prev is not new and record.get("previous_until_ms") is not None:
            until = record["previous_until_ms"]
            prev.until_ms = until if prev.until_ms is None else min(prev.until_ms, until)
        return None


# -- writing ----------------------------------------------------------------------------------------------------

class Signer:
    """Seals the records one producer writes on the authenticated topics."""

    def seal(self, registry, type_: str, record: dict, validate: bool = True) -> bytes:
        raise NotImplementedError


def _sealed(registry, type_: str, record: dict, validate: bool, identity: str, key_id: str,
            prove: Callable[[bytes], bytes]) -> bytes:
    record["envelope"] = {**record["envelope"], "auth": auth_block(identity, key_id)}
    return seal(registry.encode(type_, record, validate=validate), identity, key_id, prove)


class ComponentSigner(Signer):
    """A control-plane principal's: HMAC under its component key; the records agents act on (``COMMANDED``) and the
    keys' announcements signed with its Ed25519 key when it has one (else they go unsigned: readers refuse them)."""

    def __init__(self, identity: str, component_secret: bytes | None, signing_key: SigningKey | None = None):
        self.identity = identity
        self.key = component_key(component_secret, identity) if component_secret else None
        self.signing_key = signing_key

    def seal(self, registry, type_: str, record: dict, validate: bool = True) -> bytes:
        sk = self.signing_key
        if type_ in SIGNED and sk is not None:
            return _sealed(registry, type_, record, validate, self.identity, sk.key_id, sk.sign)
        if self.key is None or type_ in SIGNED:
            return registry.encode(type_, record, validate=validate)
        key = self.key
        return _sealed(registry, type_, record, validate, self.identity, HMAC_KEY_ID, lambda m: mac(key, m))


class MachineSigner(Signer):
    """An agent's: each record under the key of the machine it speaks of (``key_of(machine id)``: the process agent
    knows its own; simulated agents derive any of theirs); a batch of reports with a proof per report."""

    def __init__(self, key_of: Callable[[str], bytes | None]):
        self.key_of = key_of

    def _key(self, machine_id: str) -> bytes:
        key = self.key_of(machine_id)
        if key is None:
            raise ValueError(f"this agent holds no key of machine {machine_id!r}: it cannot speak for it")
        return key

    def seal(self, registry, type_: str, record: dict, validate: bool = True) -> bytes:
        where = MACHINE_SPEECH.get(type_)
        if where is None:
            raise ValueError(f"a machine does not write {type_}")
        if where == ITEMS:
            ent = record["envelope"]["entitlement"]
            record[ITEMS] = [{**r, "proof": item_proof(self._key(r["machine_id"]), ent, r)} for r in record[ITEMS]]
            return registry.encode(type_, record, validate=validate)
        mid = record[where]
        key = self._key(mid)
        return _sealed(registry, type_, record, validate, machine_identity(mid), HMAC_KEY_ID, lambda m: mac(key, m))


# -- reading ----------------------------------------------------------------------------------------------------

# What ``Verifier.check`` reads of a record that is no batch of reports, as dotted fields: the envelope's ``auth``
# (its three fields: all None for the null branch) and time, and the field naming the machine a machine speaks of. A
# reader that skims records instead of decoding them (``streams.clients.SkimReader``) reads these fields of the
# record and checks ``checked_record`` of them: the same ``check`` over the same bytes, without decoding the rest.
PROOF_FIELDS = ("envelope.auth.identity", "envelope.auth.key_id", "envelope.auth.proof", "envelope.timestamp_ms")


def checked_fields(type_: str) -> tuple[str, ...]:
    """The fields ``Verifier.check`` reads of a record of ``type_`` (ValueError for a batch of reports: ``check``
    reads each report, decode those)."""
    where = MACHINE_SPEECH.get(type_)
    if where == ITEMS:
        raise ValueError(f"{type_} is checked report by report: decode it")
    return PROOF_FIELDS + ((where,) if where is not None else ())


def checked_record(type_: str, values: Sequence[Any]) -> dict:
    """The part of a record of ``type_`` that ``Verifier.check`` reads, from the values of ``checked_fields(type_)``
    in that order (as a skimmer reads them)."""
    identity, key_id, proof, timestamp_ms, *named = values
    record: dict = {"envelope": {"auth": None if identity is None else
                                 {"identity": identity, "key_id": key_id, "proof": proof},
                                 "timestamp_ms": timestamp_ms}}
    if named:
        record[MACHINE_SPEECH[type_]] = named[0]
    return record


class Verifier:
    """Checks the proof of every record a reader decodes from an authenticated topic (``check``); what it cannot
    check for want of a secret it refuses (``UNVERIFIABLE``)."""

    def __init__(self, *, component_secret: bytes | None = None, machine_secret: bytes | None = None,
                 ring: KeyRing | None = None, components: Iterable[str] = ()):
        self.component_secret = component_secret
        self.machine_secret = machine_secret
        self.ring = ring
        self.components = frozenset(components) | {OPERATOR}  # the identities HMAC component proofs may name

    def check(self, type_: str, record: Mapping[str, Any], value: bytes) -> str:
        """The identity that wrote ``record`` (decoded from ``value``), proven; AuthError otherwise."""
        env = record["envelope"]
        auth = env.get("auth")
        if auth is None:
            if MACHINE_SPEECH.get(type_) == ITEMS:
                return self._reports(record)
            raise AuthError(UNSIGNED, f"{type_} carries no proof of who wrote it")
        who, kid, proof = auth["identity"], auth["key_id"], auth["proof"]
        msg = message(value, who, kid, proof)
        if kid != HMAC_KEY_ID:
            return self._signed(type_, env, who, kid, proof, msg)
        machine = machine_of(who)
        if machine is not None:
            self._speaks_for(type_, record, machine)
            if self.machine_secret is None:
                raise AuthError(UNVERIFIABLE, f"this reader cannot check a machine's proof ({who})")
            key = machine_key(self.machine_secret, machine)
        else:
            if who not in self.components:
                raise AuthError(WRONG_IDENTITY, f"{who!r} is no component of the region")
            if type_ in COMMANDED:
                raise AuthError(WRONG_IDENTITY, f"{type_} must be signed (Ed25519) for agents to check it, "
                                                f"not MACed by {who}")
            if self.component_secret is None:
                raise AuthError(UNVERIFIABLE, f"this reader cannot check a component's proof ({who})")
            key = component_key(self.component_secret, who)
        if not hmac.compare_digest(mac(key, msg), proof):
            raise AuthError(BAD_PROOF, f"the proof of {who} does not verify")
        return who

    def _signed(self, type_: str, env: Mapping[str, Any], who: str, kid: str, proof: bytes, msg: bytes) -> str:
        allowed = COMMANDED.get(type_)
        if allowed is not None and who not in allowed and who != OPERATOR:
            raise AuthError(WRONG_IDENTITY, f"{type_} comes from {' or '.join(sorted(allowed))} (or the operator), "
                                            f"not {who}")
        if self.ring is None:
            raise AuthError(UNVERIFIABLE, "this reader has no public keys")
        if not self.ring.key(who, kid, env["timestamp_ms"]).verify(proof, msg):
            raise AuthError(BAD_PROOF, f"the signature of {who} ({kid}) does not verify")
        return who

    @staticmethod
    def _speaks_for(type_: str, record: Mapping[str, Any], machine: str) -> None:
        where = MACHINE_SPEECH.get(type_)
        if where is None:
            raise AuthError(WRONG_IDENTITY, f"a machine ({machine}) does not write {type_}")
        named = {r.get("machine_id") for r in record[ITEMS]} if where == ITEMS else {record.get(where)}
        if named != {machine}:
            raise AuthError(WRONG_IDENTITY, f"machine {machine} speaks for {', '.join(sorted(map(str, named)))}")

    def _reports(self, record: Mapping[str, Any]) -> str:
        """An agent's batch of reports: each report proves its own machine."""
        ent = record["envelope"]["entitlement"]
        machines = set()
        for r in record[ITEMS]:
            mid, proof = r.get("machine_id"), r.get("proof")
            if proof is None or mid is None:
                raise AuthError(UNSIGNED, f"report {r['report_id']} of {r['task_id']} carries no proof")
            if self.machine_secret is None:
                raise AuthError(UNVERIFIABLE, "this reader cannot check a machine's proof")
            if not hmac.compare_digest(item_proof(machine_key(self.machine_secret, mid), ent, r), proof):
                raise AuthError(BAD_PROOF, f"report {r['report_id']} of {r['task_id']}: the proof of machine {mid} "
                                           f"does not verify")
            machines.add(mid)
        return machine_identity(next(iter(machines))) if len(machines) == 1 else ANY_MACHINES
