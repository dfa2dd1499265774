"""The topic catalogue: names, partition counts, keys, config; and idempotent provisioning.

Entitlement-keyed topics are co-partitioned: same partition count and the same partitioner (murmur2,
Kafka's Java default, which aiokafka/faust use too; our confluent-kafka producers are configured with
`murmur2_random` to match). So one scheduler shard sees all of an entitlement's intents, machines,
allocations, tasks and TaskControl traffic on the same partition number. Free-pool machine events use the
key `free/<dc>`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

KEY_ENTITLEMENT = "entitlement"  # envelope.entitlement (free/<dc> for free-pool machines)
KEY_MACHINE = "machine"  # machine id
KEY_JOB = "job"  # job id
KEY_FINGERPRINT = "fingerprint"  # schema fingerprint, hex
KEY_ORIGIN = "origin"  # the failed record's own key


def free_pool_key(dc: str) -> str:
    return f"free/{dc}"


@dataclass(frozen=True)
class TopicSpec:
    name: str  # logical name; the physical name is prefix + name
    key: str  # what the record key is (KEY_*)
    events: tuple[str, ...]  # event types carried
    copartitioned: bool = False  # part of the entitlement-keyed group
    partitions: int | None = None  # None: the configured partition count
    config: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    doc: str = ""


_COMPACT = MappingProxyType({"cleanup.policy": "compact"})

CATALOGUE: tuple[TopicSpec, ...] = (
    TopicSpec("intents", KEY_ENTITLEMENT, ("EntitlementCreated", "EntitlementUpdated", "JobSubmitted",
              "JobSpecChanged", "JobResized", "JobStopped"), True, doc="user intent from the front end"),
    TopicSpec("machines", KEY_ENTITLEMENT, ("MachineRegistered", "MachineStatusChanged",
              "MachineAssignedToEntitlement", "MachineReleasedToFreePool", "HostProfileApplied"), True,
              doc="machine registry and ownership; free-pool machines keyed free/<dc>"),
    TopicSpec("unavailability", KEY_ENTITLEMENT, ("UnavailabilityStarted", "UnavailabilityEnded"), True,
              doc="failures, maintenance and power events"),
    TopicSpec("allocations", KEY_ENTITLEMENT, ("AllocationRequested", "TasksAllocated", "AllocationRejected",
              "TasksDeallocated"), True, doc="allocator requests and decisions, with reasons"),
    TopicSpec("tasks", KEY_ENTITLEMENT, ("TaskCommanded", "TaskStateChanged", "ServiceDiscoveryChanged"), True,
              doc="task commands to agents and task state changes"),
    TopicSpec("taskcontrol", KEY_ENTITLEMENT, ("TaskControlRequested", "TaskControlAcked"), True,
              doc="TaskControl requests to application controllers and their acks"),
    TopicSpec("heartbeats", KEY_MACHINE, ("AgentHeartbeat",), doc="agent liveness, high volume"),
    TopicSpec("deadletter", KEY_ORIGIN, ("DeadLetterRecorded",), partitions=1,
              doc="records that failed to decode or validate, with reason and origin"),
    TopicSpec("state.jobs", KEY_JOB, ("JobStatePublished",), config=_COMPACT,
              doc="latest state per job (take the last record per key: compaction is not enforced by Tansu)"),
    TopicSpec("state.machines", KEY_MACHINE, ("MachineStatePublished",), config=_COMPACT,
              doc="latest state per machine"),
    TopicSpec("_schemas", KEY_FINGERPRINT, (), partitions=1, config=_COMPACT,
              doc="every writer schema, JSON, keyed by fingerprint: the log is its own schema registry"),
)

BY_NAME: Mapping[str, TopicSpec] = MappingProxyType({t.name: t for t in CATALOGUE})
TOPIC_OF_EVENT: Mapping[str, str] = MappingProxyType({e: t.name for t in CATALOGUE for e in t.events})


class TopicError(RuntimeError):
    pass


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


def provision(admin, topics: Topics, timeout_s: float = 15.0) -> dict:
    """Create missing topics and check the partition counts of existing ones. Idempotent.

    `admin` is a confluent_kafka.admin.AdminClient. Raises TopicError if partition counts disagree.
    """
    from confluent_kafka import KafkaError
    from confluent_kafka.admin import NewTopic

    md = admin.list_topics(timeout=timeout_s)
    existing = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
    problems = check_copartitioning(topics, existing)
    if problems:
        raise TopicError("; ".join(problems))
    missing = [s for s in CATALOGUE if topics.name(s.name) not in existing]
    created = []
    if missing:
        futures = admin.create_topics(
            [NewTopic(topics.name(s.name), topics.partitions_of(s.name), 1, config=dict(s.config)) for s in missing],
            operation_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                created.append(name)
            except Exception as exc:  # a concurrent provision created it first: fine
                err = exc.args[0] if exc.args else None
                if not (hasattr(err, "code") and err.code() == KafkaError.TOPIC_ALREADY_EXISTS):
                    raise TopicError(f"cannot create topic {name}: {exc}") from None
        md = admin.list_topics(timeout=timeout_s)
        existing = {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}
        problems = check_copartitioning(topics, existing)
        if problems:
            raise TopicError("; ".join(problems))
    return {"created": sorted(created), "topics": {n: existing.get(n) for n in topics.all()}}
