"""The keys behind the identities on the log (streams/auth.py): where each one lives, who holds what, rotation.

**Files** (in the secrets directory, 0600, written whole and renamed into place; what each holds is
``infra/credentials.py``'s, with the other credentials):

    trust.json            the operator's, on the host that runs ``up``: every private key and secret of the region
                          {"operator": KEY, "signers": {"scheduler": KEY, "sidekick": KEY},
                           "component_secret": B64, "machine_secret": B64}    KEY = {"key_id", "private", "public"}
    <principal>.json      each principal's own file gets a "trust" section (``infra.credentials.principal_trust``), derived from it
    machines/<id>.json    one machine's own key, all its agent holds of the region's secrets (``write_machine_key``)
    machine-secret.json   the machine secret alone, for the simulated agents (one process stands for many machines,
                          so it holds every machine's key: a test region's trust stops at them)

**Who holds what** (``infra.credentials.principal_trust``):

| principal | holds |
|---|---|
| every one | the operator's public key (the anchor: a key announced on the ``keys`` topic counts only if signed by it, or by the identity's previous key) and the commanders' public keys as they were when the file was written |
| scheduler, sidekick | its Ed25519 private key: signs the commands agents run (task commands; host-profile requests) |
| operator | its Ed25519 private key (signs what the CLI's direct path commands, and the announcements) |
| the control plane's principals that read or write ``tasks``, ``machines`` or ``heartbeats`` (``VERIFIERS``) | the component secret (their HMAC identities) and the machine secret (they verify any machine) |
| agent | nothing more: a machine's key is in its own file |

**Where the scheduler's private key lives**: in ``scheduler.json`` (0600), the file only its workers read. **How agents
learn its public key**: pinned in ``agent.json`` when the operator writes it, and from the ``keys`` topic for every
later rotation, which counts only when signed by the operator's key (pinned in every file) or by the scheduler's
previous key: a file distributed once stays good across rotations, and no agent trusts the log for its first key.

**Rotation** (``rotation``, ``ropewalk keys rotate IDENTITY``): a new key pair for the identity, its announcement on
``keys`` signed by the old key (``by="old"``) or by the operator's, the previous key accepted for records dated up to
``overlap_ms`` after it (agents accept both meanwhile), and the identity's file rewritten with the new private key.
The running workers sign with the key they started with until they are started again (the supervisor does it:
``kill`` the worker, or ``ropewalk down`` / ``up``), within the overlap. ``overlap_ms=0`` revokes the old key at once.
The two HMAC secrets are not rotated by a command (every machine's key derives from one): a new ``trust.json`` and
new machine keys, with the region stopped.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from infra.acls import reader_group
from infra.credentials import (AGENT, MACHINE_SECRET_FILE, MACHINES_DIR, OPERATOR, PRINCIPALS, SIGNERS, TRUST_FILE,
                               CredentialsError, new_key_doc, principal_file, principal_trust, read_json, signer_doc,
                               write_principal_files, write_private)
from infra.private import write_private_if_changed
from streams.auth import ComponentSigner, KeyRing, MachineSigner, PublicKey, SigningKey, Verifier, machine_key
from streams.events import Event, derived_event_id, new_event
from streams.serde import DecodeError, SchemaRegistry
from streams.topics import Topics

DEFAULT_OVERLAP_MS = 24 * 3600 * 1000


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


# -- what one process holds --------------------------------------------------------------------------------------

def trust_doc(secrets_dir: Path) -> dict | None:
    """The operator's ``trust.json`` (None: none)."""
    return read_json(Path(secrets_dir) / TRUST_FILE)


def section(cfg) -> dict | None:
    """The trust section of ``cfg``'s principal: from its own file, else (a host with only the operator's files)
    derived from ``trust.json``; None: a region without keys (nothing is signed nor checked)."""
    own = read_json(principal_file(cfg.secrets, cfg.principal))
    if own is not None and "trust" in own:
        return own["trust"]
    return principal_trust(trust_doc(cfg.secrets), cfg.principal)


def _public_keys(sec: Mapping[str, Any]) -> tuple[PublicKey, list[PublicKey]]:
    anchor = PublicKey(OPERATOR, sec["anchor"]["key_id"], unb64(sec["anchor"]["public"]))
    pinned = [PublicKey(who, k["key_id"], unb64(k["public"])) for who, k in (sec.get("pinned") or {}).items()]
    return anchor, pinned


def signing_key(identity: str, key: Mapping[str, Any]) -> SigningKey:
    """A KEY document (``trust.json``'s, or a principal file's ``signing_key``) as a ``SigningKey``."""
    return SigningKey(identity, key["key_id"], unb64(key["private"]))


def signer_for(cfg) -> ComponentSigner | None:
    """The signer of a control-plane process (None: an agent's, which seals as its machines, and a region without
    keys)."""
    sec = section(cfg)
    if sec is None or cfg.principal == AGENT:
        return None
    sk = sec.get("signing_key")
    secret = sec.get("component_secret")
    return ComponentSigner(cfg.principal, unb64(secret) if secret else None,
                           signing_key(cfg.principal, sk) if sk else None)


def verifier_for(cfg, registry: SchemaRegistry | None = None) -> Verifier | None:
    """The verifier of ``cfg``'s principal (None: a region without keys). Its key ring reads the ``keys`` topic
    (``LogKeys``) when it meets a key it does not know, and every ``auth.REFRESH_S`` while used."""
    sec = section(cfg)
    if sec is None:
        return None
    anchor, pinned = _public_keys(sec)
    ring = KeyRing(anchor, pinned, fetch=LogKeys(cfg, registry))
    cs, ms = sec.get("component_secret"), sec.get("machine_secret")
    return Verifier(component_secret=unb64(cs) if cs else None, machine_secret=unb64(ms) if ms else None, ring=ring,
                    components=(p for p in PRINCIPALS if p != AGENT))


class LogKeys:
    """A key ring's ``fetch``: the SigningKeyAnnounced records of the ``keys`` topic (one partition) written since the
    last call, as ``(record, value)``. Its consumer (assign-only: no group) is made at the first call and kept; an
    unreachable broker: nothing new (the keys known stay the ones known)."""

    def __init__(self, cfg, registry: SchemaRegistry | None = None, timeout_s: float = 10.0):
        self.cfg = cfg
        self.registry = registry
        self.timeout_s = timeout_s
        self.topic = Topics(cfg.topic_prefix, cfg.partitions).name("keys")
        self.consumer: Any = None
        self.next_offset = 0
        self.errors = 0

    def __call__(self) -> list[tuple[dict, bytes]]:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition  # noqa: PLC0415 - start-up cost: confluent_kafka (~40 ms), only to read the key ring from the log; `ropewalk keys machine` imports this module without it

        if self.registry is None:
            self.registry = SchemaRegistry.from_dir()
        out: list[tuple[dict, bytes]] = []
        try:
            if self.consumer is None:
                self.consumer = Consumer(self.cfg.kafka_conf(**{
                    "group.id": reader_group(self.cfg, "keys"), "enable.auto.commit": False,
                    "enable.partition.eof": True, "log_level": 0}))
                self.consumer.assign([TopicPartition(self.topic, 0, OFFSET_BEGINNING)])
            _, end = self.consumer.get_watermark_offsets(TopicPartition(self.topic, 0), timeout=5)
            deadline = time.monotonic() + self.timeout_s
            while self.next_offset < end and time.monotonic() < deadline:
                for msg in self.consumer.consume(1000, 0.2):
                    if msg.error() is not None:
                        continue
                    self.next_offset = msg.offset() + 1
                    try:
                        type_, record = self.registry.decode(msg.value())
                    except DecodeError:
                        continue
                    if type_ == "SigningKeyAnnounced":
                        out.append((record, msg.value()))
        except Exception:  # noqa: BLE001 - the broker away: nothing new now, asked again later
            self.errors += 1
        return out

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None


# -- machines ----------------------------------------------------------------------------------------------------

def machine_key_file(secrets_dir: Path, machine_id: str) -> Path:
    """Where a machine's own key is kept (``machines/<id>.json``)."""
    if not machine_id or "/" in machine_id or machine_id.startswith("."):
        raise CredentialsError(f"machine id {machine_id!r} cannot name a key file")
    return Path(secrets_dir) / MACHINES_DIR / f"{machine_id}.json"


def write_machine_key(secrets_dir: Path, machine_id: str, out: Path | None = None) -> Path:
    """Write ``machine_id``'s own key (derived from ``trust.json``'s machine secret) to its file, or to ``out``: the
    one secret to give that machine's agent (``--machine-key``)."""
    doc = trust_doc(secrets_dir)
    if not doc or "machine_secret" not in doc:
        raise CredentialsError(f"{Path(secrets_dir) / TRUST_FILE} holds no machine secret: `ropewalk up` makes it")
    path = Path(out) if out is not None else machine_key_file(secrets_dir, machine_id)
    key = machine_key(unb64(doc["machine_secret"]), machine_id)
    write_private_if_changed(path, json.dumps({"machine_id": machine_id, "key": b64(key)}, indent=1) + "\n")
    return path


def machine_signer(cfg, machine_id: str, key_file: Path | None = None) -> MachineSigner | None:
    """The process agent's signer: its machine's key, from ``key_file`` (default ``machines/<id>.json``). None in a
    region without keys; CredentialsError, saying what to do, when the region has keys and the file is missing."""
    if section(cfg) is None:
        return None
    path = Path(key_file) if key_file else machine_key_file(cfg.secrets, machine_id)
    doc = read_json(path)
    if doc is None:
        raise CredentialsError(f"no key for machine {machine_id} at {path}: the operator writes it with `ropewalk "
                               f"keys machine {machine_id}` (and gives the file to this machine)")
    if doc.get("machine_id") != machine_id or "key" not in doc:
        raise CredentialsError(f"{path} is not the key of machine {machine_id}")
    key = unb64(doc["key"])
    return MachineSigner(lambda mid: key if mid == machine_id else None)


def simulated_signer(cfg) -> MachineSigner | None:
    """The simulated agents' signer: any machine's key, from the machine secret (``machine-secret.json``). None in a
    region without keys."""
    if section(cfg) is None:
        return None
    doc = read_json(Path(cfg.secrets) / MACHINE_SECRET_FILE)
    if doc is None:
        raise CredentialsError(f"no {Path(cfg.secrets) / MACHINE_SECRET_FILE}: the simulated agents stand for every "
                               f"machine and need the machine secret (`ropewalk up` writes it)")
    secret = unb64(doc["machine_secret"])
    return MachineSigner(lambda mid: machine_key(secret, mid))


# -- rotation ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rotation:
    """A key rotation decided (``rotation``): the announcement, who signs it, and the ``trust.json`` after it."""

    announcement: Event
    signer: ComponentSigner  # seals the announcement (the operator's key, or the identity's old one)
    doc: dict  # trust.json with the new key
    summary: dict


def rotation(doc: Mapping[str, Any], identity: str, now_ms: int, *, overlap_ms: int = DEFAULT_OVERLAP_MS,
             by: str = "operator") -> Rotation:
    """A new Ed25519 key for ``identity`` (one of ``SIGNERS``), its SigningKeyAnnounced signed by the operator's key
    (``by="operator"``) or by the identity's current one (``by="old"``), the previous key accepted for records dated up
    to ``overlap_ms`` after ``now_ms`` (0: revoked at once). ``doc``: the operator's ``trust.json``. Pure but for the
    new key's randomness."""
    if identity not in SIGNERS:
        raise ValueError(f"{identity!r} has no signing key; these do: {', '.join(SIGNERS)}")
    if by not in ("operator", "old"):
        raise ValueError(f"by: 'operator' or 'old', got {by!r}")
    if overlap_ms < 0:
        raise ValueError(f"overlap_ms must not be negative, got {overlap_ms}")
    old = signer_doc(doc, identity)
    if old is None:
        raise CredentialsError(f"trust.json holds no key of {identity}")
    new = new_key_doc(identity)
    who, signed_by = (identity, old) if by == "old" else (OPERATOR, doc["operator"])
    until = now_ms + overlap_ms
    ev = new_event("SigningKeyAnnounced", {
        "identity": identity, "key_id": new["key_id"], "public_key": unb64(new["public"]),
        "previous_key_id": old["key_id"], "previous_until_ms": until, "previous_public_key": unb64(old["public"]),
        "reason": "revocation" if overlap_ms == 0 else "rotation"}, entitlement="", entity_id=identity,
        producer=OPERATOR, timestamp_ms=now_ms, event_id=derived_event_id("keys", identity, new["key_id"]))
    after = json.loads(json.dumps(doc))
    if identity == OPERATOR:
        after["operator"] = new
    else:
        after.setdefault("signers", {})[identity] = new
    return Rotation(ev, ComponentSigner(who, None, signing_key(who, signed_by)), after,
                    {"identity": identity, "key_id": new["key_id"], "previous_key_id": old["key_id"],
                     "previous_until_ms": until, "signed_by": f"{who} ({signed_by['key_id']})",
                     "event_id": ev.event_id})


def save(secrets_dir: Path, doc: Mapping[str, Any]) -> None:
    """Write ``trust.json`` and the principals' files after it (a rotation's ``doc``)."""
    write_private(Path(secrets_dir) / TRUST_FILE, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    write_principal_files(secrets_dir)


def ring_keys(ring: KeyRing) -> list[dict]:
    """What a key ring accepts, for people: each key, whose, until when, and whether it is the anchor."""
    return [{"identity": k.identity, "key_id": k.key_id, "public": b64(k.raw), "until_ms": k.until_ms,
             "anchor": k is ring.anchor} for k in sorted(ring.keys.values(), key=lambda k: (k.identity, k.key_id))]
