"""What each principal may do on the broker: the region's Kafka ACLs, in one table.

``WRITES`` and ``READS`` name the logical topics (``streams/topics.py``) each principal writes and reads; the faust
processors also own their consumer group and internal topics (``FAUST_APPS``: changelogs, named after the app id).
``bindings`` turns the table into Kafka ACL bindings for one region (topic prefix) and its users; ``provision``
creates them (idempotent: the broker keeps one copy of each binding) and ``drop`` deletes exactly them. The
embedded broker runs Kafka's ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``: what the table
does not allow is refused (``TOPIC_AUTHORIZATION_FAILED``). ``operator`` is a super user (``infra/broker.py``): the
CLI's direct path, ``up``'s provisioning, archive/restore, rebuild and the tests act as it.

Writers per topic, and where a topic-level ACL cannot tell writers apart:

| topic            | written by (besides operator)        | gap the ACL leaves, and who closes it |
|------------------|--------------------------------------|---------------------------------------|
| intents          | api (users' intents), scheduler (IntentRefused), rebalancer (RebalancePlanned), jobcontrol (JobSpecReconciled, its IntentRefused), srm (sizing intents, owner srm), lender (an elastic borrower's quota: EntitlementUpdated of a loan) | the scheduler could forge an intent; it is trusted with every task command anyway. The rebalancer could too; its plans only move tasks the scheduler checks (a move the entitlement's job does not hold is not made). jobcontrol, srm and lender could write any intent type: the topic-level ACL cannot tell types apart |
| machines         | resourcebroker, health, allocator, api (admins' machine fail/recover, maintenance end), agent (HostProfileApplied/Failed) | closed by identities (streams/auth.py): every record proves its writer, a component (HMAC under a secret agents do not hold) or a machine speaking of itself (its own key); readers dead-letter the rest. A control-plane principal could pass for another (they share the component secret) |
| unavailability   | resourcebroker, health, api (admins' maintenance, machine fail, power loss and restore), lender (a revocation's notice, vacate) | agents read it: the simulated machines go dark on a power UE (processors/agent/power.py) |
| allocations      | scheduler (AllocationRequested), allocator (TasksAllocated, AllocationRejected, TasksDeallocated) | the scheduler could forge a placement: agents trust the allocations topic, written only by these two |
| tasks            | scheduler (commands, its own task transitions), agent (reports), sidekick (HostProfileRequested) | closed by identities: commands are signed with the scheduler's Ed25519 key (Sidekick's requests with its own), which agents check, and no older than the last one applied (processors/agent/gate.py); each report is proven by its machine's key and the scheduler checks it. A genuine record copied again (a machine's old report) still verifies: README, "What is still open" |
| partitionmap     | api (a new entitlement's partition), scheduler (moves) | not sealed (streams/auth.py): no agent may write it; the API could move an entitlement, the scheduler is trusted with every command anyway |
| handoff          | scheduler (hand-overs, forwarded records) | not sealed: the scheduler's alone |
| loans            | lender (LoanGranted, LoanRevoked, LoanReturned) | |
| metrics          | agent (JobLoadReported: the load signals) | an agent could report another job's load: the SRM sizes within the job's min/max only |
| taskcontrol      | scheduler (requests, throttling), controller (acks) | a controller could ack another job's request: the scheduler ignores acks of a stale or unknown sequence |
| heartbeats       | agent | closed by identities: each heartbeat is proven by its machine's key, and one dated ahead of the health check's clock is refused |
| state.jobs, state.tasks | scheduler | |
| state.machines   | allocator | |
| deadletter       | every processor | an agent could write a dead letter that no reader refused: an audit nuisance, nothing acts on them |
| _schemas         | every principal (each producer publishes its writer schemas) | a schema published under a fingerprint already known is ignored (streams/serde.py) |
| keys             | (operator only) | announcements count only when signed by the operator's key or the identity's previous one |
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping

from infra.config import Config
from infra.credentials import (AGENT, ALLOCATOR, API, CONTROLLER, HEALTH, JOBCONTROL, LENDER, OPERATOR, REBALANCER,
                               RESOURCEBROKER, SCHEDULER, SIDEKICK, SRM, kafka_usernames)
from streams.topics import CATALOGUE, Topics

READ, WRITE = "READ", "WRITE"
SCHEMAS, DEADLETTER, MAP = "_schemas", "deadletter", "partitionmap"
DATA = tuple(t.name for t in CATALOGUE if t.name != SCHEMAS)

WRITES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    API: ("intents", "machines", "unavailability", MAP, SCHEMAS),
    SCHEDULER: ("intents", "allocations", "tasks", "taskcontrol", "state.jobs", "state.tasks", "handoff", MAP,
                DEADLETTER, SCHEMAS),
    ALLOCATOR: ("allocations", "machines", "state.machines", DEADLETTER, SCHEMAS),
    RESOURCEBROKER: ("machines", "unavailability", DEADLETTER, SCHEMAS),
    HEALTH: ("machines", "unavailability", DEADLETTER, SCHEMAS),
    AGENT: ("tasks", "heartbeats", "machines", "metrics", DEADLETTER, SCHEMAS),  # machines: its host-profile answers
    CONTROLLER: ("taskcontrol", DEADLETTER, SCHEMAS),
    REBALANCER: ("intents", DEADLETTER, SCHEMAS),  # RebalancePlanned
    SIDEKICK: ("tasks", DEADLETTER, SCHEMAS),  # HostProfileRequested
    JOBCONTROL: ("intents", DEADLETTER, SCHEMAS),
    SRM: ("intents", DEADLETTER, SCHEMAS),
    LENDER: ("loans", "intents", "unavailability", DEADLETTER, SCHEMAS),  # intents: a borrower's quota
})
# Every principal that produces entitlement-keyed records reads the partition map (streams/partitionmap.py), and every
# one reads ``keys``: the public keys records are checked with (streams/auth.py), written by the operator alone.
KEYS = "keys"
READS: Mapping[str, tuple[str, ...]] = MappingProxyType({p: tuple(dict.fromkeys((*topics, KEYS))) for p, topics in {
    API: (*DATA, SCHEMAS),  # state, replay, the verdict of a submission, server-sent events
    SCHEDULER: ("intents", "machines", "unavailability", "allocations", "tasks", "taskcontrol", "handoff", MAP,
                SCHEMAS),
    ALLOCATOR: ("intents", "machines", "unavailability", "allocations", "state.machines", MAP, SCHEMAS),
    RESOURCEBROKER: ("machines", "unavailability", MAP, SCHEMAS),
    HEALTH: ("machines", "heartbeats", MAP, SCHEMAS),
    AGENT: ("tasks", "allocations", "unavailability", MAP, SCHEMAS),  # unavailability: the simulated machines' power
    CONTROLLER: ("taskcontrol", MAP, SCHEMAS),
    REBALANCER: ("intents", "machines", "unavailability", "allocations", "state.jobs", MAP, SCHEMAS),  # its TOPICS
    SIDEKICK: ("intents", "machines", "unavailability", "allocations", "tasks", MAP, SCHEMAS),
    JOBCONTROL: ("intents", MAP, SCHEMAS),
    SRM: ("intents", "metrics", MAP, SCHEMAS),
    LENDER: ("machines", "intents", "unavailability", "allocations", "loans", MAP, SCHEMAS),
}.items()})
# faust apps: principal -> app id (its consumer group `<prefix><app>` and internal topics `<prefix><app>-...`).
FAUST_APPS: Mapping[str, str] = MappingProxyType({SCHEDULER: "scheduler", ALLOCATOR: "allocator"})
FAUST_TOPIC_OPERATIONS = ("READ", "WRITE", "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS")
READER_GROUPS = "ropewalk-"  # prefix (after the region's) of the group ids of assign-only readers
POSITION_GROUPS = READER_GROUPS + "position-"  # ... of the groups a worker's reader commits its position to


def reader_group(cfg: Config, name: str = "reader") -> str:
    """The group id of a consumer that assigns its partitions itself and never joins nor commits: librdkafka needs
    one anyway (and asks for its coordinator, which the broker authorizes: every principal may DESCRIBE the groups
    ``<prefix>ropewalk-*`` of its region, ``grants``)."""
    return f"{cfg.topic_prefix}{READER_GROUPS}{name}"


def position_group(cfg: Config, name: str) -> str:
    """The group a worker's assigning reader named ``name`` commits its position to, for Kafka's lag tools
    (``streams.clients.EventConsumer``'s ``follows``): ``<prefix>ropewalk-position-<name>``, the name's characters
    outside ``[A-Za-z0-9._-]`` as ``-`` (``agent/local-msb1-r01-m001`` → ``agent-local-msb1-r01-m001``)."""
    return f"{cfg.topic_prefix}{POSITION_GROUPS}{re.sub(r'[^A-Za-z0-9._-]', '-', name)}"


def allowed(principal: str, topic: str, operation: str) -> bool:
    """Whether the table lets ``principal`` do ``operation`` (READ, WRITE) on logical ``topic``. Pure."""
    if principal == OPERATOR:
        return True
    table = WRITES if operation == WRITE else READS
    return topic in table.get(principal, ())


@dataclass(frozen=True)
class Grant:
    principal: str
    resource: str  # "topic" or "group"
    name: str  # physical name (or prefix)
    prefixed: bool
    operation: str  # a Kafka AclOperation name


def grants(prefix: str) -> list[Grant]:
    """The table as grants on the physical names of a region with topic prefix ``prefix``. Pure."""
    topics = Topics(prefix)
    out = []
    for table, op in ((READS, READ), (WRITES, WRITE)):
        for principal, names in table.items():
            out += [Grant(principal, "topic", topics.name(t), False, op) for t in names]
    for principal in READS:  # the group ids of readers that assign partitions themselves (reader_group)
        out.append(Grant(principal, "group", f"{prefix}{READER_GROUPS}", True, "DESCRIBE"))
        # a worker's reader commits its position to its own group (position_group): READ on the group
        out.append(Grant(principal, "group", f"{prefix}{POSITION_GROUPS}", True, READ))
    for principal, app in FAUST_APPS.items():
        out.append(Grant(principal, "group", prefix + app, True, READ))
        out += [Grant(principal, "topic", f"{prefix}{app}-", True, op) for op in FAUST_TOPIC_OPERATIONS]
    # the API places a new entitlement on the least-loaded scheduler shard: it asks the scheduler group who owns
    # which partition (DescribeGroups: processors/frontend/service.py, shard_owners)
    out.append(Grant(API, "group", prefix + FAUST_APPS[SCHEDULER], False, "DESCRIBE"))
    return out


def bindings(prefix: str, usernames: Mapping[str, str]) -> list:
    """confluent-kafka ``AclBinding``s of ``grants(prefix)`` for the principals' Kafka users (``usernames``:
    principal -> user; a principal without a user gets none)."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~5 ms over confluent_kafka); streams.clients imports this module in every process, only `up` and the bench manage ACLs

    out = []
    for g in grants(prefix):
        user = usernames.get(g.principal)
        if user is None:
            continue
        out.append(AclBinding(ResourceType.TOPIC if g.resource == "topic" else ResourceType.GROUP, g.name,
                              ResourcePatternType.PREFIXED if g.prefixed else ResourcePatternType.LITERAL,
                              f"User:{user}", "*", getattr(AclOperation, g.operation), AclPermissionType.ALLOW))
    return out


def provision(admin, prefix: str, usernames: Mapping[str, str], timeout_s: float = 30.0, *, wait: bool = True):
    """Create the region's ACLs (an existing binding is left as it is). Returns how many bindings; with
    ``wait=False`` the futures instead (``wait_for`` them: the caller does something else meanwhile)."""
    wanted = bindings(prefix, usernames)
    futures = list(admin.create_acls(wanted, request_timeout=timeout_s).values()) if wanted else []
    if not wait:
        return futures
    wait_for(futures)
    return len(wanted)


def drop(admin, prefix: str, usernames: Mapping[str, str], timeout_s: float = 30.0, *, wait: bool = True):
    """Delete the region's ACLs (those ``provision`` made for ``prefix``); ``wait=False``: the futures."""
    from confluent_kafka.admin import AclBindingFilter  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~5 ms over confluent_kafka); streams.clients imports this module in every process, only `up` and the bench manage ACLs

    filters = [AclBindingFilter(b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation,
                                b.permission_type) for b in bindings(prefix, usernames)]
    futures = list(admin.delete_acls(filters, request_timeout=timeout_s).values()) if filters else []
    if wait:
        wait_for(futures)
    return futures


def wait_for(futures: Iterable) -> None:
    for fut in futures:
        fut.result()


def provision_region(cfg, admin=None, *, wait: bool = True):
    """``provision`` for the region of ``cfg`` (its topic prefix, the users of its secrets directory); nothing when
    the region has no Kafka credentials (a broker without authentication). Waited for (``wait``), on a cluster of
    several brokers it returns once each of them enforces the bindings (``wait_until_known``)."""
    admin = admin or _admin(cfg)
    out = provision(admin, cfg.topic_prefix, _users(cfg), wait=wait)
    if wait and out:
        brokers = admin.list_topics(timeout=15).brokers
        if len(brokers) > 1:
            wait_until_known(cfg.kafka_conf(), brokers, bindings(cfg.topic_prefix, _users(cfg)))
    return out


def wait_until_known(conf: Mapping, brokers: Mapping, wanted: list, timeout_s: float = 60.0) -> None:
    """Wait until each of ``brokers`` (id -> confluent ``BrokerMetadata``) describes every binding of ``wanted``. A
    broker's authorizer learns new bindings from the controller's metadata log on its own time (seconds under load):
    until then it refuses what they allow (a worker started at once died of TOPIC_AUTHORIZATION_FAILED). Each broker
    is asked by a client that knows it alone (``conf`` with it as the bootstrap server)."""
    from confluent_kafka.admin import (AclBindingFilter, AclOperation, AclPermissionType, AdminClient,  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~5 ms over confluent_kafka); streams.clients imports this module in every process, only `up` and the bench manage ACLs
                                       ResourcePatternType, ResourceType)

    def key(b) -> tuple:
        return (b.restype, b.name, b.resource_pattern_type, b.principal, b.host, b.operation, b.permission_type)

    every = AclBindingFilter(ResourceType.ANY, None, ResourcePatternType.ANY, None, None, AclOperation.ANY,
                             AclPermissionType.ANY)
    want = {key(b) for b in wanted}
    deadline = time.monotonic() + timeout_s
    for b in brokers.values():
        admin = AdminClient({**conf, "bootstrap.servers": f"{b.host}:{b.port}", "log_level": 0})
        while True:
            try:
                missing = len(want - {key(x) for x in admin.describe_acls(every, request_timeout=5).result()})
            except Exception:  # noqa: BLE001 - not answering: asked again
                missing = len(want)
            if not missing:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"broker {b.id} ({b.host}:{b.port}) does not know {missing} of the region's "
                                   f"{len(want)} ACL bindings {timeout_s:.0f}s after they were created")
            time.sleep(0.2)


def drop_region(cfg, admin=None, *, wait: bool = True):
    return drop(admin or _admin(cfg), cfg.topic_prefix, _users(cfg), wait=wait)


def _users(cfg) -> dict[str, str]:
    return {p: u for p, u in kafka_usernames(cfg.secrets).items() if p != OPERATOR}


def _admin(cfg):
    from confluent_kafka.admin import AdminClient  # noqa: PLC0415 - start-up cost: confluent_kafka.admin (~5 ms over confluent_kafka); streams.clients imports this module in every process, only `up` and the bench manage ACLs

    return AdminClient({**cfg.kafka_conf(), "log_level": 0})
