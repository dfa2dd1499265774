"""The topic catalogue: names, partition counts, keys, config; and idempotent provisioning.

Entitlement-keyed topics are co-partitioned: same partition count and the same partitioner (murmur2,
Kafka's Java default, which aiokafka/faust use too; our confluent-kafka producers are configured with
`murmur2_random` to match). So one scheduler shard sees all of an entitlement's intents, machines,
allocations, tasks and TaskControl traffic on the same partition number. Free-pool machine events use the
key `free/<dc>`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from infra.config import REPLICATED_FROM

# confluent-kafka is imported inside the functions that provision and ask the broker (~20 ms, measured with
# -X importtime): the catalogue is read on every path, `ropewalk --help` included, and most readers never provision.

KEY_ENTITLEMENT = "entitlement"  # envelope.entitlement (free/<dc> for free-pool machines)
KEY_MACHINE = "machine"  # machine id
KEY_JOB = "job"  # job id
KEY_ENTITY = "entity"  # envelope entity_id (state.tasks: <job id>#<part>)
KEY_FINGERPRINT = "fingerprint"  # schema fingerprint, hex
KEY_ORIGIN = "origin"  # the failed record's own key


# The free pool (the machines no entitlement owns): one concept, written in four fields whose types and readers
# differ, so each encoding has a name of its own, here and nowhere else.
FREE_POOL_KEY_PREFIX = "free/"  # the key (envelope.entitlement) of events about a free machine: free/<dc>
FREE_POOL_LENDER = "free"  # LoanGranted.lender of a loan made from the free pool (on the log: fixed)
FREE_POOL_OWNER = ""  # the owner of a free machine in the allocator's fold and its Redis index (a string field)
FREE_POOL_ENTITLEMENT = None  # placement.Machine.entitlement of a free machine (an optional field)


def free_pool_key(dc: str) -> str:
    return f"{FREE_POOL_KEY_PREFIX}{dc}"


def is_free_pool_key(key: str) -> bool:
    """A key of events about a free machine (``free_pool_key``), not an entitlement's."""
    return key.startswith(FREE_POOL_KEY_PREFIX)


@dataclass(frozen=True)
class TopicSpec:
    name: str  # logical name; the physical name is prefix + name
    key: str  # what the record key is (KEY_*)
    events: tuple[str, ...]  # event types carried
    copartitioned: bool = False  # part of the entitlement-keyed group
    partitions: int | None = None  # None: the configured partition count
    config: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    doc: str = ""


# Retention, chosen per topic (the table is README.md "Retention"; each TopicSpec's doc says why):
#
# * KEPT: the topics that state is folded from at every start from offset 0 (the allocator's fold and `rebuild`,
#   the Resource Broker's, the health check's machines, the upper floors' intents, an agent without its state file
#   reads `tasks` and `allocations` from the beginning to learn what it runs, a TaskController rebuilds its books)
#   and that time travel (`ropewalk at`, shadow, explain) folds: retention.ms=-1, never deleted by age or size.
#   Deleting their old segments needs every one of those readers to start from a snapshot or a compacted state
#   first; until then they keep everything, and their growth per simulated day is measured by
#   `ropewalk experiment soak` (RELIABILITY.md). `rebuild.py` refuses a partition that no longer starts at 0.
# * TIME-BOUNDED: read only from an offset a reader stores or from the end, or judged on recent samples; nothing
#   is folded from them: heartbeats and metrics (a day), handoff (a week: a hand-over is adopted in seconds; a
#   shard's stored offset of it older than that is a shard down for a week), deadletter (30 days and 1 GiB: the
#   operator's to read, `ropewalk replay --topic deadletter`). Kafka deletes whole closed segments only, so each
#   rolls its segment often enough (segment.ms) for the retention to be what it says.
# * COMPACTED: the latest value per key (state.*, partitionmap, _schemas, faust's changelogs): bounded by the keys
#   alive (a stopped job's keys get tombstones once its grace passed: processors/scheduler/README.md "Stopped jobs
#   leave"). The log cleaner compacts closed segments only, so such a topic rolls its active segment after
#   COMPACT_SEGMENT_MS (or 64 MiB): a key overwritten many times keeps at most that window of old records plus the
#   cleaned ones. It compacts a segment once half of the log is overwritten (min.cleanable.dirty.ratio, Kafka's
#   default 0.5); tombstones stay a day (delete.retention.ms) so a slow reader still sees a delete. retention.ms
#   does not apply to cleanup.policy=compact; it is set to -1 anyway so a switch to compact,delete would not start
#   deleting.
#
# What time travel, replay and shadow reach: time travel and shadow read only KEPT topics, so every moment since
# the region began (or since the archive it was restored from began) stays reachable; a KEPT partition that no
# longer starts at offset 0 (deleted by hand) makes a look that needs its beginning say the moment is gone
# (`processors.history.reader.MomentGone`). `replay` of a TIME-BOUNDED topic reaches its retention; `ropewalk
# archive` copies the whole log (the cold tier) and `ropewalk restore` brings an archive back to be read.
# The config applies when provisioning creates a topic; an existing topic keeps the config it was created with.
HOUR_MS = 3600 * 1000
DAY_MS = 24 * HOUR_MS
COMPACT_SEGMENT_MS = HOUR_MS
TOMBSTONE_RETENTION_MS = DAY_MS
_KEEP_FOREVER = MappingProxyType({"retention.ms": "-1"})
CHANGELOG_CONFIG = MappingProxyType({"segment.ms": str(COMPACT_SEGMENT_MS), "segment.bytes": str(64 * 1024 * 1024),
                                     "delete.retention.ms": str(TOMBSTONE_RETENTION_MS)})
_COMPACT = MappingProxyType({"cleanup.policy": "compact", "retention.ms": "-1", **CHANGELOG_CONFIG})


def _bounded(retention_ms: int, segment_ms: int, retention_bytes: int | None = None) -> Mapping[str, str]:
    """A time-bounded topic: records older than ``retention_ms`` deleted (and, per partition, beyond
    ``retention_bytes``), segments rolled every ``segment_ms`` so that deletion happens on time."""
    conf = {"retention.ms": str(retention_ms), "segment.ms": str(segment_ms)}
    if retention_bytes is not None:
        conf["retention.bytes"] = str(retention_bytes)
    return MappingProxyType(conf)


HEARTBEAT_RETENTION_MS = DAY_MS  # liveness is judged on the last seconds; a day to look back at with replay
_HEARTBEATS = _bounded(HEARTBEAT_RETENTION_MS, HOUR_MS, 1024 * 1024 * 1024)
HANDOFF_RETENTION_MS = 7 * DAY_MS
DEADLETTER_RETENTION_MS = 30 * DAY_MS

CATALOGUE: tuple[TopicSpec, ...] = (
    TopicSpec("intents", KEY_ENTITLEMENT, ("EntitlementCreated", "EntitlementUpdated", "JobSubmitted",
              "JobSpecChanged", "JobResized", "JobStopped", "IntentRefused", "RebalancePlanned", "PushIntentDeclared",
              "CanaryIntentDeclared", "SizingIntentDeclared", "ResourcesIntentDeclared", "JobSpecReconciled",
              "EntitlementElasticityChanged", "EntitlementMoveRequested"), True,
              config=_KEEP_FOREVER,
              doc="user intent from the front end, per-dimension intents and the Job Control Plane's reconciled "
                  "specs, the ReBalancer's plans, and the scheduler's refusals"),
    TopicSpec("machines", KEY_ENTITLEMENT, ("MachineRegistered", "MachineStatusChanged",
              "MachineAssignedToEntitlement", "MachineReleasedToFreePool", "HostProfileApplied",
              "MachinesStatusChanged", "HostProfileFailed", "ZoneDisruptionChanged", "MachinesRegistered"), True,
              config=_KEEP_FOREVER, doc="machine registry and ownership; free-pool machines keyed free/<dc>"),
    TopicSpec("unavailability", KEY_ENTITLEMENT, ("UnavailabilityStarted", "UnavailabilityEnded"), True,
              config=_KEEP_FOREVER, doc="failures, maintenance and power events"),
    TopicSpec("allocations", KEY_ENTITLEMENT, ("AllocationRequested", "TasksAllocated", "AllocationRejected",
              "TasksDeallocated"), True, config=_KEEP_FOREVER, doc="allocator requests and decisions, with reasons"),
    TopicSpec("tasks", KEY_ENTITLEMENT, ("TaskCommanded", "TaskStateChanged", "ServiceDiscoveryChanged",
              "TasksCommanded", "TaskStatesChanged", "ServiceDiscoveryUpdated", "TaskCommandRefused",
              "HostProfileRequested"), True, config=_KEEP_FOREVER,
              doc="task and host-profile commands to agents, task state changes, and agents' refusals of commands"),
    TopicSpec("taskcontrol", KEY_ENTITLEMENT, ("TaskControlRequested", "TaskControlAcked", "OperationsThrottled"),
              True, config=_KEEP_FOREVER,
              doc="TaskControl requests to application controllers and their acks"),
    TopicSpec("handoff", KEY_ENTITLEMENT, ("EntitlementHandedOver",), True,
              config=_bounded(HANDOFF_RETENTION_MS, DAY_MS),
              doc="an entitlement moving to this partition: its state handed over by the shard it leaves, then the "
                  "records that shard forwards (header forwarded_from); read by the scheduler alone, from its stored "
                  "offsets, and adopted in seconds: kept a week"),
    TopicSpec("partitionmap", KEY_ENTITLEMENT, ("EntitlementPartitionAssigned",), partitions=1, config=_COMPACT,
              doc="where each entitlement lives: the partition producers send its events to (compacted; none: its "
                  "key's hash partition)"),
    TopicSpec("loans", KEY_ENTITLEMENT, ("LoanGranted", "LoanRevoked", "LoanReturned"), True, config=_KEEP_FOREVER,
              doc="elastic compute: machines the Resource Broker lends to elastic entitlements and takes back"),
    TopicSpec("metrics", KEY_ENTITLEMENT, ("JobLoadReported",), True, config=_HEARTBEATS,
              doc="load signals per job for the autoscaler, which sizes on recent load; kept a day like heartbeats"),
    TopicSpec("keys", KEY_ENTITY, ("SigningKeyAnnounced",), partitions=1, config=_KEEP_FOREVER,
              doc="the public keys agents verify commands with, and their rotations, each signed by the operator's key "
                  "or the identity's previous one (streams/auth.py); written by the operator, read by every principal"),
    TopicSpec("heartbeats", KEY_MACHINE, ("AgentHeartbeat",), config=_HEARTBEATS,
              doc="agent liveness, high volume, read from its end (the health check): kept a day "
                  "(HEARTBEAT_RETENTION_MS) and at most 1 GiB per partition"),
    TopicSpec("deadletter", KEY_ORIGIN, ("DeadLetterRecorded",), partitions=1,
              config=_bounded(DEADLETTER_RETENTION_MS, DAY_MS, 1024 * 1024 * 1024),
              doc="records that failed to decode or validate, with reason and origin; the operator's to read: kept 30 "
                  "days and at most 1 GiB"),
    TopicSpec("state.jobs", KEY_JOB, ("JobStatePublished",), config=_COMPACT,
              doc="latest state per job (compacted: the latest record per key)"),
    TopicSpec("state.tasks", KEY_ENTITY, ("JobTasksPublished",), config=_COMPACT,
              doc="latest state of the tasks of jobs of more than 500 tasks, per chunk of 500 (key <job>#<part>)"),
    TopicSpec("state.machines", KEY_MACHINE, ("MachineStatePublished",), config=_COMPACT,
              doc="latest state per machine"),
    TopicSpec("_schemas", KEY_FINGERPRINT, (), partitions=1, config=_COMPACT,
              doc="every writer schema, JSON, keyed by fingerprint: the log is its own schema registry"),
)

BY_NAME: Mapping[str, TopicSpec] = MappingProxyType({t.name: t for t in CATALOGUE})
TOPIC_OF_EVENT: Mapping[str, str] = MappingProxyType({e: t.name for t in CATALOGUE for e in t.events})


class TopicError(RuntimeError):
    pass


# Replication. Every topic Ropewalk creates (the catalogue, faust's changelogs) gets the region's replication factor
# (infra/config.py: 1 on one embedded node, 3 on an embedded cluster; on an external cluster ROPEWALK_REPLICATION_FACTOR,
# or as many as it has brokers, at most REPLICATED_FROM) and the min.insync.replicas below. Producers write with
# acks=all: a write is acknowledged once every in-sync replica has it, and refused (NOT_ENOUGH_REPLICAS, retried)
# while fewer than min.insync.replicas are in sync, so an acknowledged write is on that many brokers.
def min_insync_replicas(replication_factor: int) -> int:
    """The in-sync replicas a write needs on a topic of ``replication_factor`` replicas: a majority from 3 up (2 of 3:
    any one broker may be lost, writes go on, and an acknowledged write is on two), else 1 (with 2 replicas, 2
    would stop every write while either broker is away). Pure."""
    return replication_factor // 2 + 1 if replication_factor >= 3 else 1


def replication_config(replication_factor: int) -> dict[str, str]:
    """The topic configuration that goes with ``replication_factor`` (``min_insync_replicas``). Pure."""
    return {"min.insync.replicas": str(min_insync_replicas(replication_factor))}


def cluster_replication_factor(brokers: int) -> int:
    """The replication factor a cluster of ``brokers`` brokers gets when the region does not say: one replica per
    broker, at most REPLICATED_FROM. Pure."""
    return max(1, min(REPLICATED_FROM, brokers))


def replication_factor(cfg, admin=None, timeout_s: float = 15.0) -> int:
    """The replicas of the topics ``cfg``'s region creates: ``cfg.replication_factor``, or (an external cluster that
    does not say) ``cluster_replication_factor`` of the brokers the cluster lists (asked through ``admin``)."""
    if cfg.replication_factor is not None:
        return cfg.replication_factor
    if admin is None:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})
    return cluster_replication_factor(len(admin.list_topics(timeout=timeout_s).brokers))


@dataclass(frozen=True)
class Topics:
    """The catalogue as configured: physical names (with prefix) and partition counts."""

    prefix: str = ""
    partitions: int = 8

    def name(self, logical: str) -> str:
        if logical not in BY_NAME:
            raise TopicError(f"unknown topic {logical!r}; known: {', '.join(BY_NAME)}")
        return self.prefix + logical

    def logical(self, physical: str) -> str | None:
        if physical.startswith(self.prefix) and physical[len(self.prefix):] in BY_NAME:
            return physical[len(self.prefix):]
        return None

    def compacted(self, physical: str) -> bool:
        """Whether ``physical`` is a compacted topic of the catalogue: there, and only there, a record without a
        value is a tombstone (a key deleted); anywhere else it is a bad record."""
        logical = self.logical(physical)
        return logical is not None and BY_NAME[logical].config.get("cleanup.policy") == "compact"

    def partitions_of(self, logical: str) -> int:
        spec = BY_NAME[logical]
        return spec.partitions or self.partitions

    def for_event(self, event_type: str) -> str:
        try:
            return self.name(TOPIC_OF_EVENT[event_type])
        except KeyError:
            raise TopicError(f"event type {event_type!r} belongs to no topic") from None

    def all(self) -> list[str]:
        return [self.name(t.name) for t in CATALOGUE]

    def data_topics(self) -> list[str]:
        """Every topic that carries events (all but _schemas)."""
        return [self.name(t.name) for t in CATALOGUE if t.name != "_schemas"]


def check_copartitioning(topics: Topics, existing: Mapping[str, int]) -> list[str]:
    """Problems with existing partition counts (physical name -> count). Pure."""
    problems = []
    for spec in CATALOGUE:
        phys = topics.name(spec.name)
        if phys in existing and existing[phys] != topics.partitions_of(spec.name):
            what = "co-partitioned with every entitlement-keyed topic" if spec.copartitioned else "configured"
            problems.append(
                f"topic {phys} has {existing[phys]} partitions, expected {topics.partitions_of(spec.name)} "
                f"({what}); set ROPEWALK_PARTITIONS={existing[phys]} or recreate the topic"
            )
    return problems


def provision(admin, topics: Topics, timeout_s: float = 15.0, *, replication: int | None = None,
              conf: Mapping[str, Any] | None = None) -> dict:
    """Create missing topics and check the partition counts of existing ones. Idempotent.

    `admin` is a confluent_kafka.admin.AdminClient. A topic is created with ``replication`` replicas (None: as many
    as the cluster lists brokers: ``cluster_replication_factor``) and ``replication_config``. An
    existing topic is left as it is. Raises TopicError if partition counts disagree. With ``conf`` (the confluent
    settings ``admin`` was made with), on a cluster of several brokers, returns once each of them lists the topics
    created (``wait_until_known``).
    """
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import NewTopic

    md = admin.list_topics(timeout=timeout_s)
    rf = replication if replication is not None else cluster_replication_factor(len(md.brokers))
    existing = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
    problems = check_copartitioning(topics, existing)
    if problems:
        raise TopicError("; ".join(problems))
    missing = [s for s in CATALOGUE if topics.name(s.name) not in existing]
    created = []
    if missing:
        futures = admin.create_topics(
            [NewTopic(topics.name(s.name), topics.partitions_of(s.name), rf,
                      config={**replication_config(rf), **s.config}) for s in missing],
            operation_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                created.append(name)
            except Exception as exc:  # noqa: BLE001 - a concurrent provision created it first: fine
                err = exc.args[0] if exc.args else None
                if not (err is not None and hasattr(err, "code") and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                    raise TopicError(f"cannot create topic {name}: {exc}") from None
        # Served first, then listed: right after creation the metadata may not list every new topic yet (seen
        # under load: the counts of some came back missing).
        wait_until_served(admin, {topics.name(s.name): topics.partitions_of(s.name) for s in missing})
        md = admin.list_topics(timeout=timeout_s)
        if conf is not None and len(md.brokers) > 1:
            wait_until_known(conf, md.brokers, [topics.name(s.name) for s in missing])
        existing = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
        problems = check_copartitioning(topics, existing)
        if problems:
            raise TopicError("; ".join(problems))
    return {"created": sorted(created), "topics": {n: existing.get(n) for n in topics.all()},
            "replication_factor": rf}


SERVED_TIMEOUT_S = 60.0  # how long new partitions may take to be served (~0.5 s idle; much more under load)


def wait_until_served(admin, partition_counts: Mapping[str, int], timeout_s: float = SERVED_TIMEOUT_S) -> None:
    """Wait until the broker answers ListOffsets for every partition of these topics. CreateTopics returns once
    the controller has recorded a topic; the broker that leads its partitions takes a moment more to serve them
    (until then clients get NOT_LEADER_FOR_PARTITION, or find no leader in their metadata: measured ~0.5 s for 44
    partitions on an idle machine)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import OffsetSpec

    pending = [TopicPartition(t, p) for t, n in partition_counts.items() for p in range(n)]
    deadline = time.monotonic() + timeout_s
    while pending:
        futures = admin.list_offsets({tp: OffsetSpec.latest() for tp in pending}, request_timeout=timeout_s)
        left, why = [], ""
        for tp, fut in futures.items():
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - not served yet: asked again below
                left.append(TopicPartition(tp.topic, tp.partition))
                why = str(exc)
        if left and time.monotonic() > deadline:
            raise TopicError(f"{len(left)} partitions not served {timeout_s:.0f}s after their creation, e.g. "
                             f"{left[0].topic}[{left[0].partition}]: {why}")
        pending = left
        if pending:
            time.sleep(0.1)
            # librdkafka finds the leaders in its metadata cache, which may hold the topic as created (no leader
            # yet: "No leaders found") until its next refresh, minutes away: ask for fresh metadata.
            admin.list_topics(timeout=timeout_s)


def wait_until_known(conf: Mapping[str, Any], brokers: Mapping[int, Any], names: list[str],
                     timeout_s: float = SERVED_TIMEOUT_S) -> None:
    """Wait until each of ``brokers`` (id -> confluent ``BrokerMetadata``) lists the topics ``names`` in its metadata.
    A broker learns a new topic from the controller's metadata log on its own time (seconds under load): until then a
    reader that asks it is told the topic does not exist. Each broker is asked by a client that knows it alone
    (``conf`` with it as the bootstrap server)."""
    from confluent_kafka.admin import AdminClient

    deadline = time.monotonic() + timeout_s
    for b in brokers.values():
        admin = AdminClient({**conf, "bootstrap.servers": f"{b.host}:{b.port}", "log_level": 0})
        while True:
            try:
                listed = admin.list_topics(timeout=5).topics
                missing = [n for n in names if n not in listed or listed[n].error is not None]
            except Exception as exc:  # noqa: BLE001 - not answering: asked again
                missing = [f"(no answer: {exc})"]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise TopicError(f"broker {b.id} ({b.host}:{b.port}) does not list {', '.join(missing[:3])} "
                                 f"{timeout_s:.0f}s after their creation")
            time.sleep(0.2)


def topic_id(cfg, topic: str, timeout_s: float = 10.0) -> str:
    """The Kafka id of ``topic`` (a topic deleted and created again, or restored into a new broker, has another)."""
    from confluent_kafka import TopicCollection
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({**cfg.kafka_conf(), "log_level": 0})
    desc = admin.describe_topics(TopicCollection([topic]), request_timeout=timeout_s)[topic].result(timeout_s)
    return str(desc.topic_id)
