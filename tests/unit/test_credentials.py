"""The principals' credentials (infra/credentials.py): made once, private, kept; what each client is given."""
import json
import os
import stat

import pytest

from infra import credentials as c
from infra.config import Config


def test_ensure_makes_private_files_once_and_keeps_them(tmp_path):
    d = tmp_path / "secrets"
    added = c.ensure(d)
    assert set(added[c.KAFKA_FILE]) == {*c.PRINCIPALS, c.BROKER_USER} and set(added[c.REDIS_FILE]) == set(c.REDIS_USERS)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    for f in d.iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    before = (d / c.KAFKA_FILE).read_text()
    assert c.ensure(d) == {c.KAFKA_FILE: [], c.REDIS_FILE: []}
    assert (d / c.KAFKA_FILE).read_text() == before
    pw = {p: json.loads(before)["principals"][p]["password"] for p in c.PRINCIPALS}
    assert len(set(pw.values())) == len(pw) and all(len(x) >= 32 for x in pw.values())


def test_a_principal_missing_from_an_older_file_is_added(tmp_path):
    d = tmp_path / "s"
    c.ensure(d)
    doc = json.loads((d / c.KAFKA_FILE).read_text())
    kept = doc["principals"].pop(c.CONTROLLER) and doc["principals"][c.AGENT]["password"]
    c.write_private(d / c.KAFKA_FILE, json.dumps(doc))
    assert c.ensure(d)[c.KAFKA_FILE] == [c.CONTROLLER]
    assert c.kafka_credentials(d, c.AGENT).password == kept


def test_clients_get_their_principals_credentials(tmp_path):
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path)})
    assert cfg.kafka_conf() == {"bootstrap.servers": cfg.bootstrap_servers}  # no secrets: no SASL
    assert cfg.redis_auth() == {}
    c.ensure(cfg.secrets)
    agent = cfg.as_principal(c.AGENT)
    conf = agent.kafka_conf()
    assert (conf["security.protocol"], conf["sasl.mechanism"], conf["sasl.username"]) == (
        "SASL_PLAINTEXT", "SCRAM-SHA-256", "agent")
    assert agent.redis_auth()["username"] == c.REDIS_READER
    assert cfg.as_principal(c.ALLOCATOR).redis_auth()["username"] == c.REDIS_ALLOCATOR
    kw = c.aiokafka_kwargs(agent)
    assert kw["sasl_plain_username"] == "agent" and kw["sasl_mechanism"] == "SCRAM-SHA-256"
    assert c.faust_credentials_of(c.kafka_credentials(cfg.secrets, c.SCHEDULER)).username == "scheduler"
    kcat = dict(line.split("=", 1) for line in (cfg.secrets / c.KCAT_FILE).read_text().split())
    assert kcat["sasl.username"] == "operator" and kcat["sasl.mechanism"] == "PLAIN"


def test_redis_acl_file_holds_hashes_and_switches_the_default_user_off():
    users = {u: {"username": u, "password": f"pw-{u}"} for u in c.REDIS_USERS}
    text = c.redis_acl_file(users)
    assert text.splitlines()[0].startswith("user default off")
    assert "pw-" not in text
    for reader in (c.REDIS_API, c.REDIS_READER):  # the index's read functions alone (issue 27)
        rules = text.split(f"user {reader} ")[1].splitlines()[0]
        assert rules.endswith("-@all +@connection -@dangerous +fcall_ro +hmget +hgetall") and "~* " not in rules
        assert "eval" not in rules and "@read" not in rules and "scan" not in rules
    assert "-@dangerous" in text.split("user allocator ")[1].splitlines()[0]


def test_each_principal_has_a_file_of_its_own_and_a_worker_needs_no_other(tmp_path):
    """``ensure`` writes one file per principal (its Kafka user and its Redis user, nothing else); a secrets
    directory holding only that file (a worker on another machine) gives that principal everything it connects
    with, and the operator's files with every password are not read."""
    d = tmp_path / "secrets"
    c.ensure(d)
    kafka = json.loads((d / c.KAFKA_FILE).read_text())
    for principal in c.PRINCIPALS:
        doc = json.loads(c.principal_file(d, principal).read_text())
        assert doc["kafka"]["password"] == kafka["principals"][principal]["password"]
        others = [v["password"] for p, v in kafka["principals"].items() if p != principal] + [kafka["broker"]["password"]]
        assert not any(pw in c.principal_file(d, principal).read_text() for pw in others), principal
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "scheduler.json").write_text(c.principal_file(d, c.SCHEDULER).read_text())
    cfg = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_SECRETS_DIR": str(remote)})
    here = Config.from_env({"ROPEWALK_RUN_DIR": str(tmp_path), "ROPEWALK_SECRETS_DIR": str(d)})
    sched = cfg.as_principal(c.SCHEDULER)
    assert sched.kafka_conf() == here.as_principal(c.SCHEDULER).kafka_conf()
    assert sched.redis_auth() == here.as_principal(c.SCHEDULER).redis_auth()
    assert sched.redis_auth()["username"] == c.REDIS_READER
    # another principal finds nothing of its own there (no SASL: the broker refuses it), never someone else's
    assert cfg.as_principal(c.ALLOCATOR).kafka_conf() == {"bootstrap.servers": cfg.bootstrap_servers}


def test_a_principal_file_follows_a_password_changed_by_hand_and_a_wrong_one_is_named(tmp_path):
    d = tmp_path / "s"
    c.ensure(d)
    doc = json.loads((d / c.KAFKA_FILE).read_text())
    doc["principals"][c.AGENT]["password"] = "changed-by-hand"
    c.write_private(d / c.KAFKA_FILE, json.dumps(doc))
    assert c.write_principal_files(d) == [c.AGENT]
    assert c.kafka_credentials(d, c.AGENT).password == "changed-by-hand"
    c.write_private(c.principal_file(d, c.HEALTH), json.dumps({"principal": c.AGENT, "kafka": None, "redis": None}))

    with pytest.raises(c.CredentialsError, match="health.json is not the credentials file of principal 'health'"):
        c.kafka_credentials(d, c.HEALTH)
