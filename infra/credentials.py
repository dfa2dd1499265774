"""Who is who on the broker and in Redis: the control plane's principals and their credentials.

Every process authenticates to Kafka as ONE principal (``Config.principal``; processors name their own with
``Config.as_principal``, the CLI and tests are ``operator``), and to Redis as the Redis user of that principal
(``REDIS_USER_OF``). What each principal may do on each topic is ``infra/acls.py``; which Redis commands each Redis
user may run is ``redis_acl_lines`` below.

| principal       | runs                                    | Redis user |
|-----------------|-----------------------------------------|------------|
| operator        | the CLI's direct path, `up`, tests      | operator (every command) |
| api             | the HTTP API (processors/api)           | api (read-only) |
| scheduler       | scheduler shards                        | reader (read-only) |
| allocator       | the allocator                           | allocator (its index; no FLUSHALL, CONFIG, KEYS, ...) |
| resourcebroker  | the Resource Broker                     | reader |
| health          | the Health Check Service                | reader |
| agent           | process and simulated agents            | reader |
| controller      | applications' TaskControllers           | reader |
| rebalancer      | the ReBalancer (processors/rebalancer)  | reader |
| sidekick        | Sidekick, host profiles (processors/sidekick) | reader |
| jobcontrol      | the Job Control Plane (processors/jobcontrol) | reader |
| srm             | the autoscaler (processors/srm)         | reader |
| lender          | the Resource Broker's lender of elastic loans (resourcebroker/lender.py) | reader |

The embedded broker has one more user, ``broker`` (``BROKER_USER``): the broker's own identity towards its KRaft
controller, and the administrator ``up`` uses to create the principals' SCRAM credentials. No client of the region
uses it.

**Files** (in the secrets directory, ``Config.secrets_dir``: ``ROPEWALK_SECRETS_DIR``, default ``<run dir>/secrets``;
the directory 0700, every file 0600, written whole and renamed into place):

    kafka.json   {"security_protocol": "SASL_PLAINTEXT", "mechanism": "SCRAM-SHA-256", "ssl_ca": null,
                  "principals": {"operator": {"username": "operator", "password": "..."}, ...},
                  "broker": {"username": "broker", "password": "..."}}          # broker: embedded only
    redis.json   {"users": {"operator": {"username": "operator", "password": "..."}, ...}}
    redis.acl    the embedded redis-server's ACL file: the same users, passwords as SHA-256 hashes
    kcat.conf    the operator's librdkafka settings (PLAIN), for tools: ``kcat -F <secrets>/kcat.conf -b ... -L``
    kafka-tools.properties  the operator's Java client settings, for Kafka's own tools (infra/kafka/bin/):
                 ``kafka-consumer-groups --command-config <secrets>/kafka-tools.properties ...``
    users.yaml   the API's users: token hashes, roles per entitlement (processors/api/users.py)
    token        the local region administrator's API token, read by the CLI
    <principal>.json  ONE principal's credentials, all a worker of that principal reads (``principal_file``):
                 {"principal": "scheduler", "kafka": {"security_protocol", "mechanism", "ssl_ca", "username",
                  "password"} | null, "redis": {"username", "password"} | null}   (null: no SASL / no Redis user)

**Each worker reads its own principal's file alone.** ``kafka.json`` and ``redis.json`` hold every principal's
password (and the broker's, a super user): they are the operator's, on the host that runs ``up``. ``ensure`` (and
``up``, ``write_principal_files``) derives one file per principal from them, and a process that authenticates as
a principal with such a file reads that file and nothing else of the directory. So a worker on another machine
needs one file: ``scp .run/secrets/scheduler.json host:<its secrets dir>/`` (README, "A region on several
machines"). A principal without its file falls back to ``kafka.json`` / ``redis.json`` (a directory written by hand
for an external cluster, or by an older Ropewalk: ``up`` writes the files).

``ensure(cfg)`` (run by ``ropewalk up`` and the test session) creates what is missing with random passwords
(``secrets.token_urlsafe``, 192 bits) and keeps what exists, so a region keeps its credentials across ``down`` /
``up``. Without ``kafka.json`` clients connect without SASL (an external broker without authentication); without
``redis.json`` they connect to Redis without a user.

**A real cluster.** Write ``kafka.json`` yourself, naming for each principal the user your cluster knows (the
``username`` may differ from the principal's name), with ``"security_protocol": "SASL_SSL"`` and ``"ssl_ca":
"/path/ca.pem"`` if the cluster has TLS, and ``"mechanism"`` ``SCRAM-SHA-512`` or ``PLAIN`` as it wants; give
``redis.json`` the users of your Redis (``ROPEWALK_REDIS_URL`` without a password). ``ropewalk up`` then creates
the topics and the ACLs of ``infra/acls.py`` as ``operator`` (which must be allowed to: a cluster admin), and
starts each worker as its principal. How each client is configured from these files:

* confluent-kafka (producers, consumers, admin): ``kafka_conf`` → ``security.protocol``, ``sasl.mechanism``,
  ``sasl.username``, ``sasl.password`` (``ssl.ca.location`` with a CA);
* faust / aiokafka (scheduler shards, allocator): ``faust_credentials`` → ``faust.SASLCredentials(username,
  password, mechanism, ssl_context)`` as the app's ``broker_credentials``; ``aiokafka_kwargs`` for bare aiokafka
  clients (``security_protocol``, ``sasl_mechanism``, ``sasl_plain_username``, ``sasl_plain_password``);
* redis-py: ``redis_auth`` → ``username`` / ``password`` given to ``redis.Redis.from_url``.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from infra.private import write_private, write_private_if_changed

OPERATOR = "operator"
API = "api"
SCHEDULER = "scheduler"
ALLOCATOR = "allocator"
RESOURCEBROKER = "resourcebroker"
HEALTH = "health"
AGENT = "agent"
CONTROLLER = "controller"
REBALANCER = "rebalancer"
SIDEKICK = "sidekick"
JOBCONTROL = "jobcontrol"
SRM = "srm"
LENDER = "lender"
PRINCIPALS = (OPERATOR, API, SCHEDULER, ALLOCATOR, RESOURCEBROKER, HEALTH, AGENT, CONTROLLER, REBALANCER, SIDEKICK,
              JOBCONTROL, SRM, LENDER)
BROKER_USER = "broker"  # the embedded broker's own user (super user; PLAIN, from its JAAS config)

# Redis users, and which one each principal connects as.
REDIS_OPERATOR, REDIS_ALLOCATOR, REDIS_API, REDIS_READER = "operator", "allocator", "api", "reader"
REDIS_USERS = (REDIS_OPERATOR, REDIS_ALLOCATOR, REDIS_API, REDIS_READER)
REDIS_USER_OF: Mapping[str, str] = {OPERATOR: REDIS_OPERATOR, ALLOCATOR: REDIS_ALLOCATOR, API: REDIS_API}

DEFAULT_PROTOCOL = "SASL_PLAINTEXT"
DEFAULT_MECHANISM = "SCRAM-SHA-256"
SCRAM_ITERATIONS = 4096  # Kafka's minimum for SCRAM-SHA-256, and what its tools use by default

KAFKA_FILE = "kafka.json"
PRINCIPAL_FILE = "{principal}.json"  # one principal's own credentials (principal_file)
KCAT_FILE = "kcat.conf"
JAVA_TOOLS_FILE = "kafka-tools.properties"
REDIS_FILE = "redis.json"
REDIS_ACL_FILE = "redis.acl"
TRUST_FILE = "trust.json"  # the keys behind the identities on the log (below, and infra/trust.py)
MACHINES_DIR = "machines"  # one file per machine: its own key (infra/trust.write_machine_key)
MACHINE_SECRET_FILE = "machine-secret.json"  # the machine secret alone: the simulated agents'

# Identities on the log (streams/auth.py). Who signs (Ed25519) what agents run, and who else holds a private key:
COMMANDERS = (SCHEDULER, SIDEKICK)  # task commands; host-profile requests (streams/auth.COMMANDED)
SIGNERS = (OPERATOR, *COMMANDERS)
# Who holds the two HMAC secrets (the components' identities, and any machine's key to check its records): the
# control plane's principals that read or write a topic agents may write (streams/auth.AUTHENTICATED: tasks,
# machines, heartbeats; infra/acls.py's table, which tests/unit/test_trust_keys.py checks this against).
VERIFIERS = (OPERATOR, API, SCHEDULER, ALLOCATOR, RESOURCEBROKER, HEALTH, REBALANCER, SIDEKICK, LENDER)


class CredentialsError(RuntimeError):
    """A secrets file that cannot be used, with what to do about it."""


@dataclass(frozen=True)
class KafkaCredentials:
    security_protocol: str
    mechanism: str
    username: str
    password: str
    ssl_ca: str | None = None


def new_password() -> str:
    return secrets.token_urlsafe(24)


# -- files -----------------------------------------------------------------------------------------------------

def read_json(path: Path) -> dict | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CredentialsError(f"cannot read {path}: {exc.strerror}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CredentialsError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CredentialsError(f"{path}: expected a JSON object")
    return doc


def ensure(secrets_dir: Path, *, kafka: bool = True, redis: bool = True) -> dict[str, list[str]]:
    """Create the secrets directory and, for the embedded services (``kafka``, ``redis``), their credential files
    with a random password for every principal / Redis user missing from them. Existing passwords are kept.
    Returns what was added, per file."""
    secrets_dir = Path(secrets_dir)
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(secrets_dir, 0o700)
    added: dict[str, list[str]] = {}
    if kafka:
        path = secrets_dir / KAFKA_FILE
        doc = read_json(path) or {"security_protocol": DEFAULT_PROTOCOL, "mechanism": DEFAULT_MECHANISM,
                                  "ssl_ca": None, "principals": {}}
        principals = doc.setdefault("principals", {})
        new = [p for p in PRINCIPALS if p not in principals]
        for p in new:
            principals[p] = {"username": p, "password": new_password()}
        if "broker" not in doc:
            doc["broker"] = {"username": BROKER_USER, "password": new_password()}
            new.append(BROKER_USER)
        if new or not path.exists():
            write_private(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        # PLAIN, not SCRAM: Debian's kcat links librdkafka 2.0.2, whose SCRAM Kafka 4 refuses (infra/broker.py).
        operator = {**librdkafka_conf(kafka_credentials(secrets_dir, OPERATOR)), "sasl.mechanism": "PLAIN"}
        write_private(secrets_dir / KCAT_FILE, "".join(f"{k}={v}\n" for k, v in operator.items()))
        write_private(secrets_dir / JAVA_TOOLS_FILE, java_client_properties(kafka_credentials(secrets_dir, OPERATOR)))
        added[KAFKA_FILE] = new
    if redis:
        path = secrets_dir / REDIS_FILE
        doc = read_json(path) or {"users": {}}
        users = doc.setdefault("users", {})
        new = [u for u in REDIS_USERS if u not in users]
        for u in new:
            users[u] = {"username": u, "password": new_password()}
        if new or not path.exists():
            write_private(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
        write_private(secrets_dir / REDIS_ACL_FILE, redis_acl_file(users))
        added[REDIS_FILE] = new
    if ensure_trust(secrets_dir):  # the keys behind the identities on the log
        added[TRUST_FILE] = ["keys"]
    write_principal_files(secrets_dir)
    return added


# -- the keys of the identities on the log (streams/auth.py; what each process does with them: infra/trust.py) ------
#
#   trust.json  the operator's: {"operator": KEY, "signers": {"scheduler": KEY, "sidekick": KEY},
#               "component_secret": B64, "machine_secret": B64}      KEY = {"key_id", "private", "public"} (Ed25519)

def new_key_doc(identity: str) -> dict:
    """A fresh Ed25519 key of ``identity`` as ``trust.json`` keeps it."""
    from streams.auth import new_signing_key  # noqa: PLC0415 - start-up cost: streams.auth (~5 ms), only to make a key; every CLI command imports this module

    sk = new_signing_key(identity)
    return {"key_id": sk.key_id, "private": _b64(sk.raw), "public": _b64(sk.public())}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def ensure_trust(secrets_dir: Path) -> bool:
    """``trust.json`` with whatever it lacks (a key per signer, the two secrets) and the simulated agents' file
    (``MACHINE_SECRET_FILE``); existing keys are kept. True if something was added."""
    path = Path(secrets_dir) / TRUST_FILE
    doc = read_json(path) or {}
    added = False
    if "operator" not in doc:
        doc["operator"], added = new_key_doc(OPERATOR), True
    signers = doc.setdefault("signers", {})
    for who in COMMANDERS:
        if who not in signers:
            signers[who], added = new_key_doc(who), True
    for name in ("component_secret", "machine_secret"):
        if name not in doc:
            doc[name], added = _b64(secrets.token_bytes(32)), True
    if added or not path.exists():
        write_private(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    sim = Path(secrets_dir) / MACHINE_SECRET_FILE
    write_private_if_changed(sim, json.dumps({"machine_secret": doc["machine_secret"]}, indent=1) + "\n")
    return added


def signer_doc(doc: Mapping[str, Any], identity: str) -> Mapping[str, Any] | None:
    """``identity``'s KEY in a ``trust.json`` document (None: it has none)."""
    return doc.get("operator") if identity == OPERATOR else (doc.get("signers") or {}).get(identity)


def principal_trust(doc: Mapping[str, Any] | None, principal: str) -> dict | None:
    """The "trust" section of ``principal``'s own file from the operator's ``trust.json`` document (None: none):
    the operator's public key (``anchor``) and the commanders' (``pinned``) for every principal; the two HMAC
    secrets for ``VERIFIERS``; its own private key for ``SIGNERS``. Pure."""
    if not doc or "operator" not in doc:
        return None
    op = doc["operator"]
    out: dict[str, Any] = {"anchor": {"key_id": op["key_id"], "public": op["public"]},
                           "pinned": {who: {"key_id": k["key_id"], "public": k["public"]}
                                      for who, k in sorted((doc.get("signers") or {}).items())}}
    if principal in VERIFIERS:
        out["component_secret"] = doc["component_secret"]
        out["machine_secret"] = doc["machine_secret"]
    own = signer_doc(doc, principal) if principal in SIGNERS else None
    if own is not None:
        out["signing_key"] = {"key_id": own["key_id"], "private": own["private"]}
    return out


# -- one principal's file --------------------------------------------------------------------------------------

def principal_file(secrets_dir: Path, principal: str) -> Path:
    """Where ``principal``'s own credentials are (``<secrets>/<principal>.json``)."""
    return Path(secrets_dir) / PRINCIPAL_FILE.format(principal=principal)


def principal_doc(principal: str, kafka: Mapping[str, Any] | None, redis_users: Mapping[str, Any] | None,
                  trust: Mapping[str, Any] | None = None) -> dict:
    """The content of ``principal``'s own file from the operator's ``kafka.json``, ``redis.json`` and ``trust.json``
    documents (None: no such file; its "trust" section: ``infra.trust.principal_trust``). Pure."""
    who = (kafka.get("principals") or {}).get(principal) if kafka is not None else None
    kafka_part = None if who is None else {
        "security_protocol": kafka.get("security_protocol") or DEFAULT_PROTOCOL,
        "mechanism": kafka.get("mechanism") or DEFAULT_MECHANISM, "ssl_ca": kafka.get("ssl_ca"),
        "username": who["username"], "password": who["password"]}
    user = (redis_users.get("users") or {}).get(redis_user(principal)) if redis_users is not None else None
    redis_part = None if user is None else {"username": user.get("username") or redis_user(principal),
                                            "password": user["password"]}
    out = {"principal": principal, "kafka": kafka_part, "redis": redis_part}
    section = principal_trust(trust, principal)
    if section is not None:
        out["trust"] = section
    return out


def write_principal_files(secrets_dir: Path) -> list[str]:
    """One file per principal (``principal_file``) from ``kafka.json`` and ``redis.json``, rewritten when it
    differs (a password changed by hand); nothing when neither exists. Returns the principals written."""
    secrets_dir = Path(secrets_dir)
    kafka, redis_users = read_json(secrets_dir / KAFKA_FILE), read_json(secrets_dir / REDIS_FILE)
    trust = read_json(secrets_dir / TRUST_FILE)
    if kafka is None and redis_users is None and trust is None:
        return []
    written = []
    for principal in PRINCIPALS:
        text = json.dumps(principal_doc(principal, kafka, redis_users, trust), indent=1, sort_keys=True) + "\n"
        if write_private_if_changed(principal_file(secrets_dir, principal), text):
            written.append(principal)
    return written


def _own(secrets_dir: Path, principal: str) -> dict | None:
    """``principal``'s own file, if it has one (a file without the expected shape is an error naming it)."""
    path = principal_file(secrets_dir, principal)
    doc = read_json(path)
    if doc is None:
        return None
    if doc.get("principal") != principal or not {"kafka", "redis"} <= doc.keys():
        raise CredentialsError(f"{path} is not the credentials file of principal {principal!r} "
                               f"(expected {{\"principal\": \"{principal}\", \"kafka\": ..., \"redis\": ...}})")
    return doc


# -- Kafka -----------------------------------------------------------------------------------------------------

def kafka_credentials(secrets_dir: Path, principal: str) -> KafkaCredentials | None:
    """The credentials ``principal`` connects with: from its own file (``principal_file``) when it has one, else
    from ``kafka.json``; None when neither says (no SASL). A ``kafka.json`` that lacks the principal is an error
    naming it."""
    own = _own(secrets_dir, principal) if principal != BROKER_USER else None
    if own is not None:
        k = own["kafka"]
        if k is None:
            return None
        if not k.get("username") or k.get("password") is None:
            raise CredentialsError(f"{principal_file(secrets_dir, principal)}: kafka needs a username and a password")
        return KafkaCredentials(security_protocol=k.get("security_protocol") or DEFAULT_PROTOCOL,
                                mechanism=k.get("mechanism") or DEFAULT_MECHANISM, username=k["username"],
                                password=k["password"], ssl_ca=k.get("ssl_ca"))
    path = Path(secrets_dir) / KAFKA_FILE
    doc = read_json(path)
    if doc is None:
        return None
    who = (doc.get("principals") or {}).get(principal)
    if principal == BROKER_USER:
        who = doc.get("broker")
    if not isinstance(who, dict) or not who.get("username") or who.get("password") is None:
        raise CredentialsError(f"{path} has no credentials for principal {principal!r} "
                               f"(known: {', '.join(sorted(doc.get('principals') or {}))})")
    return KafkaCredentials(security_protocol=doc.get("security_protocol") or DEFAULT_PROTOCOL,
                            mechanism=doc.get("mechanism") or DEFAULT_MECHANISM, username=who["username"],
                            password=who["password"], ssl_ca=doc.get("ssl_ca"))


def kafka_usernames(secrets_dir: Path) -> dict[str, str]:
    """principal -> the Kafka user it authenticates as (for the ACLs); empty without ``kafka.json``."""
    doc = read_json(Path(secrets_dir) / KAFKA_FILE) or {}
    return {p: v["username"] for p, v in (doc.get("principals") or {}).items() if isinstance(v, dict)}


def librdkafka_conf(creds: KafkaCredentials | None) -> dict[str, Any]:
    """confluent-kafka (librdkafka) settings for ``creds`` (none: no security settings). Pure."""
    if creds is None:
        return {}
    conf = {"security.protocol": creds.security_protocol, "sasl.mechanism": creds.mechanism,
            "sasl.username": creds.username, "sasl.password": creds.password}
    if creds.ssl_ca:
        conf["ssl.ca.location"] = creds.ssl_ca
    return conf


def java_client_properties(creds: KafkaCredentials | None) -> str:
    """A Java Kafka client's properties for ``creds`` (Kafka's own tools: ``--command-config``). Pure."""
    if creds is None:
        return ""
    module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if creds.mechanism == "PLAIN"
              else "org.apache.kafka.common.security.scram.ScramLoginModule")
    quoted = {k: v.replace("\\", "\\\\").replace('"', '\\"') for k, v in
              (("username", creds.username), ("password", creds.password))}
    lines = [f"security.protocol={creds.security_protocol}", f"sasl.mechanism={creds.mechanism}",
             f'sasl.jaas.config={module} required username="{quoted["username"]}" password="{quoted["password"]}";']
    if creds.ssl_ca:
        lines += ["ssl.truststore.type=PEM", f"ssl.truststore.location={creds.ssl_ca}"]
    return "\n".join(lines) + "\n"


def aiokafka_kwargs_of(creds: KafkaCredentials | None) -> dict[str, Any]:
    """aiokafka client keyword arguments for ``creds``. Pure (but for building an SSL context from a CA file)."""
    if creds is None:
        return {}
    kw: dict[str, Any] = {"security_protocol": creds.security_protocol, "sasl_mechanism": creds.mechanism,
                          "sasl_plain_username": creds.username, "sasl_plain_password": creds.password}
    if creds.security_protocol.endswith("SSL"):
        import ssl  # noqa: PLC0415 - start-up cost: ssl (~5 ms), only for an SSL listener; every CLI command imports this module

        kw["ssl_context"] = ssl.create_default_context(cafile=creds.ssl_ca)
    return kw


def faust_credentials_of(creds: KafkaCredentials | None):
    """faust's ``broker_credentials`` for ``creds`` (None: none)."""
    if creds is None:
        return None
    import faust  # noqa: PLC0415 - start-up cost: faust (~12 ms over streams.clients, ~23 ms over infra.config), only for a faust app's credentials; every process imports this module

    ssl_context = aiokafka_kwargs_of(creds).get("ssl_context")
    return faust.SASLCredentials(username=creds.username, password=creds.password, mechanism=creds.mechanism,
                                 ssl_context=ssl_context)


# -- Redis -----------------------------------------------------------------------------------------------------

def redis_user(principal: str) -> str:
    return REDIS_USER_OF.get(principal, REDIS_READER)


def redis_auth(secrets_dir: Path, principal: str, *, read_only: bool = False) -> dict[str, str]:
    """``username``/``password`` for redis-py as ``principal``'s Redis user (``read_only``: the read-only user):
    from its own file when it has one (and it is that user), else from ``redis.json``; empty without either."""
    own = _own(secrets_dir, principal)
    if own is not None and (not read_only or redis_user(principal) == REDIS_READER):
        r = own["redis"]
        return {} if r is None else {"username": r.get("username") or redis_user(principal), "password": r["password"]}
    path = Path(secrets_dir) / REDIS_FILE
    doc = read_json(path)
    if doc is None and own is not None and own["redis"] is not None:  # read_only asked of a file that is not it
        raise CredentialsError(f"{principal_file(secrets_dir, principal)} holds Redis user "
                               f"{redis_user(principal)!r}, not the read-only one, and there is no {path}")
    if doc is None:
        return {}
    user = REDIS_READER if read_only else redis_user(principal)
    who = (doc.get("users") or {}).get(user)
    if not isinstance(who, dict) or who.get("password") is None:
        raise CredentialsError(f"{path} has no Redis user {user!r} (for principal {principal!r})")
    return {"username": who.get("username") or user, "password": who["password"]}


# What each Redis user may run (Redis ACL rules). The allocator owns the index: any key, any command but the
# dangerous ones (FLUSHALL, FLUSHDB, KEYS, CONFIG, DEBUG, SHUTDOWN, CLIENT KILL, ...) except INFO, which it reads for
# its memory figures; it loads the index's function library (FUNCTION LOAD) and may FUNCTION KILL / SCRIPT KILL. The
# API and the readers run the index's registered read functions (FCALL_RO of processors/allocator/index.py's
# LIBRARY: each bounded work whatever its arguments) — no EVAL, no SCRIPT, no FUNCTION LOAD, no KILL of any kind,
# no SCAN, KEYS or other read of the whole keyspace. Redis checks every command a function calls against the
# caller's rules too, so they keep the two reads the functions make, and only on the keys those read, read-only:
# HMGET of a machine's hash (``m:<id>``, 14 fields) and HGETALL of the summary (a count per status) — never of
# ``taskres`` or ``placement``, a field per task (an HGETALL of a million fields would hold Redis, and the allocator,
# for as long as it takes). What they can do cannot stall the allocator. The default (unauthenticated) user is off.
_READS = "resetkeys %R~*m:* %R~*index:summary resetchannels -@all +@connection -@dangerous +fcall_ro +hmget +hgetall"
REDIS_RULES: Mapping[str, str] = {
    REDIS_OPERATOR: "~* &* +@all",
    REDIS_ALLOCATOR: "~* resetchannels -@all +@all -@dangerous +info",
    REDIS_API: _READS,
    REDIS_READER: _READS,
}


def redis_acl_file(users: Mapping[str, Mapping[str, str]]) -> str:
    """The embedded redis-server's ACL file for ``users`` (Redis user -> username/password). Pure.
    Passwords appear only as their SHA-256 (Redis's ``#<hex>`` form)."""
    lines = ["user default off resetkeys resetchannels -@all"]
    for user in REDIS_USERS:
        who = users.get(user)
        if who is None:
            continue
        digest = hashlib.sha256(who["password"].encode()).hexdigest()
        lines.append(f"user {who.get('username') or user} on #{digest} {REDIS_RULES[user]}")
    return "\n".join(lines) + "\n"


def aiokafka_kwargs(cfg) -> dict[str, Any]:
    """aiokafka keyword arguments for ``cfg``'s principal (``Config``)."""
    return aiokafka_kwargs_of(kafka_credentials(cfg.secrets, cfg.principal))
