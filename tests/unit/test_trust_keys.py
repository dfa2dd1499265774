"""The keys behind the identities (infra/credentials.py's trust.json, infra/trust.py): who holds what, a machine's own
key, the process agent's and the simulated agents' signers, a rotation. No broker."""
import json
import os
import stat

import pytest

from infra import credentials as c
from infra import trust
from infra.acls import READS, WRITES
from infra.config import Config
from processors.agent.decide import heartbeat
from streams import auth
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()


@pytest.fixture
def cfg(tmp_path):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)})
    c.ensure(cfg.secrets)
    return cfg


def test_the_verifiers_are_the_control_plane_principals_that_read_or_write_an_authenticated_topic():
    """credentials.VERIFIERS is a table of its own (credentials.py may not import the ACLs): it must be what the ACL
    table says."""
    derived = {p for p in c.PRINCIPALS if p != c.AGENT
               and (p == c.OPERATOR or auth.AUTHENTICATED & {*READS.get(p, ()), *WRITES.get(p, ())})}
    assert set(c.VERIFIERS) == derived


# principal -> (holds the HMAC secrets, holds an Ed25519 private key)
HOLDS = {c.OPERATOR: (True, True), c.SCHEDULER: (True, True), c.SIDEKICK: (True, True), c.HEALTH: (True, False),
         c.RESOURCEBROKER: (True, False), c.ALLOCATOR: (True, False), c.API: (True, False),
         c.REBALANCER: (True, False), c.LENDER: (True, False), c.AGENT: (False, False),
         c.CONTROLLER: (False, False), c.JOBCONTROL: (False, False), c.SRM: (False, False)}


@pytest.mark.parametrize("principal", c.PRINCIPALS)
def test_each_principal_file_holds_what_its_principal_needs_and_no_more(cfg, principal):
    doc = json.loads(c.principal_file(cfg.secrets, principal).read_text())["trust"]
    secrets_, signing = HOLDS[principal]
    assert ("component_secret" in doc, "machine_secret" in doc) == (secrets_, secrets_)
    assert ("signing_key" in doc) == signing
    owner = json.loads((cfg.secrets / c.TRUST_FILE).read_text())
    assert doc["anchor"] == {"key_id": owner["operator"]["key_id"], "public": owner["operator"]["public"]}
    assert set(doc["pinned"]) == set(c.COMMANDERS)
    assert "private" not in json.dumps(doc["pinned"]) and owner["operator"]["private"] not in json.dumps(doc) or \
        principal == c.OPERATOR


def test_ensure_keeps_the_keys_and_writes_them_private(cfg):
    before = (cfg.secrets / c.TRUST_FILE).read_text()
    assert c.ensure_trust(cfg.secrets) is False
    assert (cfg.secrets / c.TRUST_FILE).read_text() == before
    for name in (c.TRUST_FILE, c.MACHINE_SECRET_FILE):
        assert stat.S_IMODE(os.stat(cfg.secrets / name).st_mode) == 0o600
    assert json.loads((cfg.secrets / c.MACHINE_SECRET_FILE).read_text()) == {
        "machine_secret": json.loads(before)["machine_secret"]}


def test_a_machines_key_file_is_its_own_and_the_process_agent_signs_only_as_it(cfg):
    path = trust.write_machine_key(cfg.secrets, "m1")
    assert path == cfg.secrets / "machines" / "m1.json" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    signer = trust.machine_signer(cfg.as_principal(c.AGENT), "m1")

    value = signer.seal(REG, "AgentHeartbeat", heartbeat("m1", 1, 1, [], 5).to_record(1))
    verifier = trust.verifier_for(cfg.as_principal(c.HEALTH), REG)
    type_, rec = REG.decode(value)
    assert verifier.check(type_, rec, value) == "machine/m1"
    with pytest.raises(ValueError, match="no key of machine 'm2'"):
        signer.seal(REG, "AgentHeartbeat", heartbeat("m2", 1, 1, [], 5).to_record(1))
    with pytest.raises(c.CredentialsError, match="ropewalk keys machine"):
        trust.machine_signer(cfg.as_principal(c.AGENT), "m9")  # no file for m9: says what to do
    with pytest.raises(c.CredentialsError):
        trust.machine_key_file(cfg.secrets, "../etc")


def test_an_agent_cannot_verify_a_machines_proof_nor_seal_as_a_component(cfg):
    agent = cfg.as_principal(c.AGENT)
    assert trust.signer_for(agent) is None
    v = trust.verifier_for(agent, REG)
    assert v.machine_secret is None and v.component_secret is None and v.ring is not None


def test_a_region_without_keys_seals_and_checks_nothing(tmp_path):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)})
    assert trust.signer_for(cfg) is None and trust.verifier_for(cfg) is None
    assert trust.machine_signer(cfg.as_principal(c.AGENT), "m1") is None


@pytest.mark.parametrize("by", ["operator", "old"])
def test_a_rotation_is_announced_so_that_an_agent_with_an_old_file_takes_the_new_key(cfg, by):
    """The agent's file pins the scheduler's key of its day; the rotation's announcement (signed by the operator or
    by that old key) teaches it the new one, and the old one for the overlap only."""
    agent_file = json.loads(c.principal_file(cfg.secrets, c.AGENT).read_text())["trust"]
    doc = trust.trust_doc(cfg.secrets)
    rot = trust.rotation(doc, c.SCHEDULER, now_ms=1_000, overlap_ms=500, by=by)
    value = rot.signer.seal(REG, "SigningKeyAnnounced", rot.announcement.to_record(1))
    anchor, pinned = trust._public_keys(agent_file)
    ring = auth.KeyRing(anchor, pinned, fetch=lambda: [(REG.decode(value)[1], value)])
    new = trust.signing_key(c.SCHEDULER, rot.doc["signers"][c.SCHEDULER])
    old = trust.signing_key(c.SCHEDULER, doc["signers"][c.SCHEDULER])
    assert ring.key(c.SCHEDULER, new.key_id, 10_000).raw == new.public()
    assert ring.key(c.SCHEDULER, old.key_id, 1_500).key_id == old.key_id  # within the overlap
    with pytest.raises(auth.AuthError, match="key_retired"):
        ring.key(c.SCHEDULER, old.key_id, 1_501)
    assert rot.summary["signed_by"].startswith(c.OPERATOR if by == "operator" else c.SCHEDULER)
    trust.save(cfg.secrets, rot.doc)  # the scheduler's file now holds the new private key; the agent's, its public
    assert trust.signer_for(cfg.as_principal(c.SCHEDULER)).signing_key.key_id == new.key_id
    assert json.loads(c.principal_file(cfg.secrets, c.AGENT).read_text())["trust"]["pinned"][c.SCHEDULER][
        "key_id"] == new.key_id


@pytest.mark.parametrize("identity,kw,error", [("health", {}, "has no signing key"),
                                               (c.SCHEDULER, {"by": "nobody"}, "by:"),
                                               (c.SCHEDULER, {"overlap_ms": -1}, "must not be negative")])
def test_a_rotation_that_cannot_be_is_refused_naming_why(cfg, identity, kw, error):
    with pytest.raises(ValueError, match=error):
        trust.rotation(trust.trust_doc(cfg.secrets), identity, 1_000, **kw)
