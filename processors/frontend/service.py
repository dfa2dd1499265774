"""The front end's operations, once: what `ropewalk` does on the log directly and what the HTTP API does for its
users. Each validates with the rules of ``processors/rules.py`` / ``jobspec.py`` (a job spec is checked once, at
the door that read it, by ``spec_payload``; the operations take the ``ValidSpec`` it returns), produces intents with
``EventProducer`` and reads state with the readers of ``streams/state.py`` and ``streams/replay.py``; each returns
the JSON document the CLI prints with ``--json`` and the API answers.

    front = Frontend(cfg, registry, principal="alice", producer="api")
    front.job_submit(spec_payload(data, None, cfg.max_tasks_per_job))  # checked at the door: a ValidSpec
                                           # {"job": "e1.web", "entitlement": "e1", "event_id": ..., "verdict": ...}
    front.job_status("e1.web")             # job_view

A request that cannot be served raises ``FrontendError(status, reason, message)``: the CLI prints the message as
its one error line, the API answers ``status`` with ``{"error": reason, "message": message}``. Who may call what
is the API's business (``processors/api/authz.py``); the CLI's direct path is the operator's.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from typing import Any, Iterator, Mapping

from infra.config import Config
from infra.credentials import SCHEDULER
from processors import rules
from processors.frontend import describe as dsc
from processors.frontend import logs
from processors.frontend.jobspec import JobSpecError, ValidSpec, _name, check as check_spec, refuse
from processors.frontend.verdict import VerdictWatch
from processors.jobcontrol import decide as jd
from processors.resourcebroker import decide as rbd
from processors.srm import decide as sd
from streams.deadletter import Skipped
from streams.events import Event, new_event
from streams.partitionmap import (
    REASON_CREATED, MapEntry, MapFollower, PartitionMap, assignment_event, least_loaded, read_map,
)
from streams.serde import SchemaRegistry
from streams.topics import Topics
from streams.validate import describe_value

# The imports inside functions below are on purpose, for start-up cost: what reads or writes the log
# (``streams.clients``, ``streams.replay``, ``streams.state``) loads confluent-kafka, ~60 ms that ``ropewalk --help``
# and the commands that never touch the log would pay (the CLI imports this module for all of them); each of the
# others is one command family's (time travel and what-if: ``processors.history.moments`` alone ~0.8 s, with OR-Tools;
# the ReBalancer's and the ops planner's queries; the Resource Broker's, Job Control Plane's and SRM's folds; the group
# and ACL admin clients). Measured 2026-11-29 with ``python -X importtime``.

# Reasons (FrontendError.reason) and the HTTP status each answers with.
UNKNOWN_JOB = "unknown_job"
JOB_GONE = "job_gone"  # the job was stopped and is gone: what it was is still shown (job status, describe)
UNKNOWN_MACHINE = "unknown_machine"
UNKNOWN_MAINTENANCE = "unknown_maintenance"
UNKNOWN_TASK = "unknown_task"  # explain: no event names the task (up to the moment asked)
INVALID_REQUEST = "invalid_request"  # a field of the request is wrong (the message names it)
OWNER_NOT_CALLER = "owner_not_caller"  # an intent naming another owner than who declares it (issue 27)
BROKER_UNREACHABLE = "broker_unreachable"
NOT_ALLOWED_HERE = "illegal_transition"  # e.g. recover a machine in maintenance
STATUS = {OWNER_NOT_CALLER: 403, UNKNOWN_JOB: 404, JOB_GONE: 404, UNKNOWN_MACHINE: 404, UNKNOWN_MAINTENANCE: 404,
          UNKNOWN_TASK: 404, INVALID_REQUEST: 400,
          BROKER_UNREACHABLE: 503, NOT_ALLOWED_HERE: 409}

# Verdicts of an intent (``verdict`` of an answer).
ACCEPTED = "accepted"  # the scheduler applied it (its JobStatePublished caused by the intent)
REFUSED = "refused"  # the scheduler refused it (IntentRefused), or rejected the job
PENDING = "pending"  # no verdict within the wait (an identical resubmission of a live job gets none: a no-op)
SENT = "sent"  # on the log; not waited for
UNCHANGED = "unchanged"  # a submission identical to the live job's spec: the scheduler changes nothing (no refusal)

log = logging.getLogger(__name__)

OWNERS_TIMEOUT_S = 2.0  # how long a new entitlement's placement asks the scheduler group who owns which partition
DEFAULT_WAIT_S = 30.0  # how long a submission waits for the scheduler's verdict at most
EXISTING_WAIT_S = 3.0  # ... when the job exists (the scheduler answers only a refusal; it is as quick as any answer)
MAX_WAIT_S = 120.0


class FrontendError(Exception):
    def __init__(self, reason: str, message: str, status: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status or STATUS.get(reason, 400)


def job_view(ev: Event) -> dict:
    """`job status --json`: the contract in docs/architecture.md, from a JobStatePublished event."""
    p = ev.payload
    return {"job": p["job_id"], "name": p["name"], "entitlement": ev.entitlement, "state": p["state"],
            "incarnation": p.get("incarnation", 1), "spec_version": p["spec_version"],
            "desired_tasks": p["desired_tasks"], "last_reason": p["last_reason"], "updated_ms": ev.timestamp_ms,
            "deleted": bool(p.get("deleted")),
            "tasks": [{"id": t["task_id"], "state": t["state"], "machine": t["machine_id"], "dc": t["dc"],
                       "msb": t["msb"], "rack": t["rack"], "spec_version": t["spec_version"], "reason": t["reason"]}
                      for t in p["tasks"]]}


def require_broker(cfg: Config) -> None:
    """FrontendError unless the broker answers ``cfg``'s principal."""
    from infra.services import broker_ready

    if not broker_ready(cfg):
        raise FrontendError(BROKER_UNREACHABLE, f"cannot reach Kafka at {cfg.bootstrap_servers} as {cfg.principal} "
                                                f"(is `ropewalk up` running? are the credentials in {cfg.secrets} "
                                                f"this broker's?)")


def entitlement_of_job(job_id: str) -> str:
    """A job id is ``<entitlement>.<name>`` (jobspec.job_id): the entitlement it belongs to, without reading."""
    return job_id.split(".", 1)[0]


def spec_payload(data: Any, entitlement: str | None, max_tasks: int, where: str = "") -> ValidSpec:
    """A user's spec (parsed YAML/JSON) checked at a door, once: the ``ValidSpec`` that ``Frontend.job_submit`` and
    ``job_update`` take, or FrontendError naming the field (``where``: the file it came from)."""
    try:
        return check_spec(data, entitlement, max_tasks)
    except JobSpecError as exc:
        raise FrontendError(INVALID_REQUEST, f"{where}{exc}") from None


class MoveWatch:
    """Waits for the outcome of an entitlement's move: the partition map placing it on its new partition, or the
    scheduler's IntentRefused of the request (on the intents partition it was sent to)."""

    def __init__(self, cfg: Config, registry, entitlement: str, partition: int, request_id: str):
        from streams.clients import EventConsumer

        self.entitlement, self.request_id = entitlement, request_id
        self.follower = MapFollower.start(cfg, registry, name="move-watch")
        where = [(Topics(cfg.topic_prefix, cfg.partitions).name("intents"), partition)]
        self.consumer = EventConsumer(cfg, registry, [where[0][0]], name="move-watch", start_offsets={},
                                      types=("IntentRefused",))
        self.consumer.assign(self.consumer.high_watermarks(where), only=where)

    def wait(self, partition: int, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            e = self.follower.entry(self.entitlement)
            if e is not None and e.partition == partition and e.moving_to is None and e.epoch > 0:
                return {"state": "moved", "epoch": e.epoch}
            for rec in self.consumer.poll(100, 0.2, linger_s=0.0):
                p = rec.event.payload
                if p.get("intent_event_id") == self.request_id:
                    raise FrontendError(p["reason"], f"refused by the scheduler: {p['reason']}: {p.get('message', '')}",
                                        409)
        e = self.follower.entry(self.entitlement)
        return {"state": "moving" if e is not None and e.moving_to == partition else "requested"}

    def __enter__(self) -> "MoveWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.consumer.close()
        self.follower.close()


class Frontend:
    """The operations, for one principal (who asked: an API user, or ``operator`` on the CLI's direct path)."""

    def __init__(self, cfg: Config, registry=None, *, principal: str | None = None, producer: str = "cli",
                 skipped: Skipped | None = None, events=None, partition_map=None):
        self.cfg = cfg
        self.registry = registry or SchemaRegistry.from_dir()
        self.principal = principal
        self.producer_name = producer
        self.skipped = skipped if skipped is not None else Skipped()
        self._producer = events  # an EventProducer to share (the API's); None: one per call
        self._follower = partition_map  # a streams.partitionmap.MapFollower to share (the API's); None: read once
        self._map = None  # the map read once (a one-shot command's)

    # -- plumbing --------------------------------------------------------------------------------------------
    def require_broker(self) -> None:
        require_broker(self.cfg)

    def event(self, type_: str, payload: Mapping[str, Any], entitlement: str, entity_id: str) -> Event:
        return new_event(type_, payload, entitlement=entitlement, entity_id=entity_id, producer=self.producer_name,
                         principal=self.principal)

    def partition_map(self, fresh: bool = False):
        """The entitlement -> partition map (``streams.partitionmap.PartitionMap``): the shared follower's (caught up
        first when ``fresh``), else read from the log once per front end."""
        if self._follower is not None:
            if fresh:
                self._follower.catch_up(5.0)
            return PartitionMap(self.cfg.partitions, self._follower.entries())
        if self._map is None or fresh:
            self.require_broker()
            self._map = read_map(self.cfg, self.registry)
        return self._map

    def shard_owners(self) -> dict[int, str] | None:
        """Which scheduler shard owns each partition now (partition -> member of the scheduler group, from its
        assignment of ``intents``: ``streams.groups.owners``); None when the group could not be asked within
        ``OWNERS_TIMEOUT_S``. A new entitlement is then placed by partition alone, never refused for it."""
        from infra.acls import FAUST_APPS
        from streams import groups

        group = groups.app_group(self.cfg, FAUST_APPS[SCHEDULER])
        try:
            owners = groups.owners(self.cfg, group, Topics(self.cfg.topic_prefix, self.cfg.partitions).name("intents"),
                                   OWNERS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the placement falls back to partitions: the creation goes on
            log.warning("a new entitlement placed by partition alone: cannot ask group %s who owns which partition: "
                        "%s", group, exc)
            return None
        if len(owners) < self.cfg.partitions:
            log.info("a new entitlement placed by partition alone: group %s owns %d of %d partitions (no shard "
                     "running, or a rebalance under way)", group, len(owners), self.cfg.partitions)
        return owners

    def send(self, events: list[Event], *, partition: int | None = None) -> None:
        """Produce ``events``, each to the partition its entitlement lives on (or ``partition``), and flush."""
        from streams.clients import EventProducer

        producer = self._producer
        if producer is None:
            self.require_broker()
            producer = EventProducer(self.cfg, self.registry, self.producer_name,
                                     route=self.partition_map().partition_of, **{"message.timeout.ms": 15000})
        for ev in events:
            producer.send(ev, partition=partition)
        producer.flush(20)

    def stamp(self, events: list[Event]) -> list[Event]:
        """``events`` (decided elsewhere: the Resource Broker's, the Ops Planner's) with this front end's principal."""
        return [dataclasses.replace(ev, principal=self.principal) for ev in events]

    # -- entitlements ----------------------------------------------------------------------------------------
    def entitlement_create(self, name: Any, quota: Any, *, machine_type=None, dc=None, host_profile=None,
                           fields: Mapping[str, str] | None = None) -> dict:
        payload = {"name": name, "quota_machines": quota, "machine_type": machine_type, "dc_pin": dc,
                   "host_profile": host_profile}
        try:
            name = _name(name, (fields or {}).get("name", "name"))
            refuse(rules.intent_problems("EntitlementCreated", payload, name), fields)
        except JobSpecError as exc:
            raise FrontendError(INVALID_REQUEST, str(exc)) from None
        ev = self.event("EntitlementCreated", payload, name, name)
        pmap = self.partition_map(fresh=True)
        placed = pmap.entry(name)
        if placed is None:  # a new entitlement goes to the least-loaded shard's least-loaded partition, on the map
            # before it exists
            where = least_loaded(pmap.entries.values(), self.cfg.partitions, quota, self.shard_owners())
            placed = MapEntry(name, where, weight=quota, reason=REASON_CREATED)
            pmap.entries[name] = placed
            self.send([assignment_event(placed, producer=self.producer_name, cause=ev.event_id,
                                        principal=self.principal)])
        self.send([ev], partition=placed.partition)  # there whatever a producer's map says yet
        return {"entitlement": name, "event_id": ev.event_id, "partition": placed.partition}

    def entitlement_move(self, name: str, partition: Any, reason: str = "", *, wait_s: float | None = None) -> dict:
        """Move an entitlement to another partition of the entitlement-keyed topics (another scheduler shard), its
        jobs running on (``EntitlementMoveRequested``; processors/scheduler/README.md, "Moving an entitlement").
        With ``wait_s``, wait that long for the map to place it there (``state``: moved, or moving when it did not
        in time), or for the scheduler's refusal."""
        try:
            name = _name(name, "name")
        except JobSpecError as exc:
            raise FrontendError(INVALID_REQUEST, str(exc)) from None
        if isinstance(partition, bool) or not isinstance(partition, int) or not 0 <= partition < self.cfg.partitions:
            raise FrontendError(INVALID_REQUEST, f"partition: expected a partition from 0 to "
                                                 f"{self.cfg.partitions - 1}, got {partition!r}")
        pmap = self.partition_map(fresh=True)
        before = pmap.entry(name)
        if before is not None and before.moving_to is not None:
            raise FrontendError(INVALID_REQUEST, f"entitlement {name!r} is moving from partition {before.partition} "
                                                 f"to {before.moving_to} already: wait for it to arrive")
        ev = self.event("EntitlementMoveRequested", {"to_partition": partition, "reason": reason}, name, name)
        doc = {"entitlement": name, "event_id": ev.event_id, "from_partition": pmap.partition_of(name),
               "to_partition": partition}
        if not wait_s:
            self.send([ev])
            return {**doc, "state": "requested"}
        with MoveWatch(self.cfg, self.registry, name, pmap.partition_of(name), ev.event_id) as watch:
            self.send([ev])
            return {**doc, **watch.wait(partition, wait_s)}

    def entitlement_update(self, name: str, changes: Mapping[str, Any]) -> dict:
        """EntitlementUpdated with the fields ``changes`` sets (quota_machines, machine_type, dc_pin, host_profile)."""
        payload = {k: changes.get(k) for k in ("quota_machines", "machine_type", "dc_pin", "host_profile")}
        try:
            refuse(rules.intent_problems("EntitlementUpdated", payload, name))
        except JobSpecError as exc:
            raise FrontendError(INVALID_REQUEST, str(exc)) from None
        ev = self.event("EntitlementUpdated", payload, name, name)
        self.send([ev])
        return {"entitlement": name, "event_id": ev.event_id}

    def entitlements(self) -> list[dict]:
        """Every entitlement the intents log created and the scheduler did not refuse, with its latest settings."""
        from streams import replay as rp

        self.require_broker()
        types = frozenset({"EntitlementCreated", "EntitlementUpdated", "IntentRefused"})
        found: dict[str, dict] = {}
        refused: set[str] = set()
        by_event: dict[str, str] = {}
        for rec in rp.replay(self.cfg, self.registry, rp.ReplayFilter(topics=("intents",), types=types),
                             skipped=self.skipped):
            ev, p = rec.event, rec.event.payload
            if ev.type == "EntitlementCreated":
                found.setdefault(p["name"], {"entitlement": p["name"], "quota_machines": p["quota_machines"],
                                             "machine_type": p["machine_type"], "dc_pin": p["dc_pin"],
                                             "host_profile": p["host_profile"], "created_ms": ev.timestamp_ms})
                by_event[ev.event_id] = p["name"]
            elif ev.type == "EntitlementUpdated" and ev.entitlement in found:
                by_event[ev.event_id] = ev.entitlement
                found[ev.entitlement].update({k: v for k, v in p.items() if v is not None})
            elif ev.type == "IntentRefused" and p["intent_type"] == "EntitlementCreated":
                refused.add(p["intent_event_id"])
        gone = {by_event[e] for e in refused if e in by_event}
        pmap = self.partition_map(fresh=True)
        for name, row in found.items():  # where it lives (its scheduler shard's partition)
            e = pmap.entry(name)
            row["partition"] = pmap.partition_of(name)
            row["moving_to"] = e.moving_to if e is not None else None
        return [v for k, v in sorted(found.items()) if k not in gone]

    # -- jobs ------------------------------------------------------------------------------------------------
    def job_state(self, job: str, *, gone_too: bool = False) -> Event:
        """The job's latest state; ``gone_too``: also the last state of a job that was stopped and is gone (its
        ``deleted`` record), which otherwise is refused as ``job_gone`` naming when it went."""
        from streams import state

        self.require_broker()
        latest, gone = state.current_and_gone(self.cfg, self.registry, entitlement_of_job(job), skipped=self.skipped)
        if job in latest:
            return latest[job]
        if job in gone:
            if gone_too:
                return gone[job]
            raise FrontendError(JOB_GONE, f"job {job!r} was stopped and is gone since {_iso(gone[job].timestamp_ms)} "
                                          f"(`ropewalk job status {job}` shows its last state); submitting it again "
                                          f"makes a new incarnation")
        raise FrontendError(UNKNOWN_JOB, f"unknown job {job!r} (no state published for it; `ropewalk job list` "
                                         f"lists jobs)")

    def job_status(self, job: str, at: str | None = None) -> dict:
        """The job's view now (a job stopped and gone: its last state, ``deleted``), or (``at``: a moment,
        processors/history/moments.parse_moment) as it was then."""
        if at is None:
            return job_view(self.job_state(job, gone_too=True))
        self.require_broker()
        return job_view(job_state_at(self.cfg, self.registry, job, at, skipped=self.skipped))

    def job_describe(self, job: str, events: int | None = None) -> dict:
        """`job describe`: the job (a gone job's last state too), its tasks with their story, its recent events and
        its last refusals, from its events on the log (``processors/frontend/describe.py``)."""
        from streams import replay as rp

        view = job_view(self.job_state(job, gone_too=True))
        run = rp.replay(self.cfg, self.registry, rp.ReplayFilter(entitlement=entitlement_of_job(job), job=job),
                        skipped=self.skipped)
        docs = sorted((json.loads(rp.format_json(rec)) for rec in run), key=rp.time_order_key)
        return dsc.describe(view, docs, _now_ms(), events=dsc.EVENTS_SHOWN if events is None else events)

    def job_log_sources(self, job: str, task: str | None = None) -> list[dict]:
        """`job logs`: where each task's output is, or why it has none (``processors/frontend/logs.py``)."""
        view = job_view(self.job_state(job, gone_too=True))
        try:
            return logs.sources(view, self.cfg.run_dir, task)
        except LookupError as exc:
            raise FrontendError(UNKNOWN_TASK, str(exc)) from None

    def jobs(self, entitlement: str | None = None) -> list[dict]:
        from streams import state

        self.require_broker()
        latest = state.current(self.cfg, self.registry, "jobs", entitlement, skipped=self.skipped)
        return [job_view(ev) for _, ev in sorted(latest.items())]

    def job_submit(self, spec: ValidSpec, *, wait_s: float | None = None, where: str = "") -> dict:
        """JobSubmitted for ``spec`` (checked at the door: ``spec_payload``); with ``wait_s``, wait that long at most for the scheduler's verdict. The job
        existing already, the scheduler answers only a refusal (a spec that differs, a job still stopping) and
        says nothing to an identical submission: then the wait is ``EXISTING_WAIT_S`` at most."""
        from streams import state

        payload, ent = spec.payload, spec.entitlement
        ev = self.event("JobSubmitted", {**payload, "spec_version": 1}, ent, payload["job_id"])
        existing = None
        if wait_s:
            self.require_broker()
            existing = state.current(self.cfg, self.registry, "jobs", ent, skipped=self.skipped).get(payload["job_id"])
        doc = self._sent(ev, payload["job_id"], min(wait_s, EXISTING_WAIT_S) if existing is not None else wait_s)
        if existing is not None and doc["verdict"] == PENDING:  # not refused: the spec is the job's own
            doc["verdict"] = UNCHANGED
            doc["message"] = (f"job {payload['job_id']} exists ({existing.payload['state']}) with this spec: nothing "
                              f"changed (a spec that differs is refused: `ropewalk job update` changes it)")
        return {"job": payload["job_id"], "entitlement": ent, "event_id": ev.event_id, **doc}

    def job_update(self, job: str, spec: ValidSpec, *, wait_s: float | None = None, where: str = "") -> dict:
        """JobSpecChanged for ``spec`` (checked at the door with the job's entitlement: ``spec_payload(data,
        entitlement_of_job(job), ...)``)."""
        current = self.job_state(job)
        if spec.job_id != job:
            raise FrontendError(INVALID_REQUEST, f"{where}name: the spec names job {spec.job_id!r}, not {job!r}")
        payload = spec.payload
        version = current.payload["spec_version"] + 1
        ev = self.event("JobSpecChanged", {**payload, "spec_version": version}, current.entitlement, job)
        return {"job": job, "spec_version": version, "event_id": ev.event_id, **self._sent(ev, job, wait_s)}

    def job_resize(self, job: str, tasks: Any, *, wait_s: float | None = None, field: str = "tasks") -> dict:
        if (problem := rules.task_count(tasks, self.cfg.max_tasks_per_job, field, low=0)) is not None:
            raise FrontendError(INVALID_REQUEST, str(problem))
        current = self.job_state(job)
        ev = self.event("JobResized", {"job_id": job, "tasks": tasks}, current.entitlement, job)
        return {"job": job, "tasks": tasks, "event_id": ev.event_id, **self._sent(ev, job, wait_s)}

    def job_stop(self, job: str, reason: str = "", *, wait_s: float | None = None) -> dict:
        current = self.job_state(job)
        ev = self.event("JobStopped", {"job_id": job, "reason": reason}, current.entitlement, job)
        return {"job": job, "event_id": ev.event_id, **self._sent(ev, job, wait_s)}

    def _sent(self, ev: Event, job: str, wait_s: float | None) -> dict:
        """Send the intent; with ``wait_s``, wait for the scheduler's verdict on it (``verdict.py``)."""
        if not wait_s:
            self.send([ev])
            return {"verdict": SENT}

        self.require_broker()
        with VerdictWatch(self.cfg, self.registry, ev, job,  # positioned before the intent is sent, where it goes
                          intents_partition=self.partition_map().partition_of(ev.entitlement)) as watch:
            self.send([ev])
            got = watch.wait(min(float(wait_s), MAX_WAIT_S))
        if got is None:
            return {"verdict": PENDING, "reason": "", "message": f"no verdict from the scheduler within {wait_s:g} s"}
        return {"verdict": got.verdict, "reason": got.reason, "message": got.message, "state": got.state}

    # -- machines and maintenance ---------------------------------------------------------------------------
    def machines(self, entitlement: str | None = None, free: bool = False, at: str | None = None) -> list[dict]:
        """Every machine's view now, or (``at``) as ``machine list`` showed it then."""
        from streams import state

        self.require_broker()
        if at is not None:
            rows = machine_views_at(self.cfg, self.registry, at, entitlement, skipped=self.skipped)
        else:
            latest = state.current(self.cfg, self.registry, "machines", entitlement, skipped=self.skipped)
            rows = [state.machine_view(ev) for _, ev in sorted(latest.items())]
        return [r for r in rows if r["entitlement"] is None] if free else rows

    def rebalance_plans(self, entitlement: str | None = None, every: bool = False) -> list[dict]:
        """The ReBalancer's plans on the log (the latest per entitlement, or ``every`` one), each move with its
        progress (``processors/rebalancer/queries.plans``)."""
        from processors.rebalancer import queries as rb

        self.require_broker()
        return rb.plans(self.cfg, self.registry, entitlement, every=every, skipped=self.skipped)

    # -- the region at a moment, why a task is where it is (processors/history) ----------------------------
    def region(self, at: str) -> dict:
        """The whole region at the moment ``at``: machines, entitlements, jobs and their tasks."""
        self.require_broker()
        return region_doc(self.cfg, self.registry, at, skipped=self.skipped)

    def explain(self, task: str, at: str | None = None, why_not: str | None = None) -> dict:
        """The decision that placed ``task`` (as of ``at``), the filters' rejections, the events that led to it."""
        self.require_broker()
        return explain_doc(self.cfg, self.registry, task, at, why_not, skipped=self.skipped)

    def machine_action(self, machine: str, action: str, *, dry_run: bool = False) -> dict:
        """``fail`` (→ DOWN, its tasks move) or ``recover`` (→ UP) a machine; ``dry_run`` (fail only): what would
        happen (processors/history/whatif.py), nothing produced."""
        from processors.resourcebroker.processor import fail_machine, recover_machine

        if action not in ("fail", "recover"):
            raise FrontendError(INVALID_REQUEST, f"action: expected fail or recover, got {action!r}")
        if dry_run and action != "fail":
            raise FrontendError(INVALID_REQUEST, "dry_run: only a failure has a dry run")
        self.require_broker()
        fn = fail_machine if action == "fail" else recover_machine
        try:
            if dry_run:
                from processors.history import whatif

                return whatif.machine_failure(self.cfg, self.registry, machine, int(time.time() * 1000),
                                              skipped=self.skipped)
            ids = fn(self.cfg, machine, registry=self.registry, skipped=self.skipped, principal=self.principal)
        except rbd.UnknownMachine as exc:
            raise FrontendError(UNKNOWN_MACHINE, str(exc)) from None
        except rbd.IllegalStatusTransition as exc:
            raise FrontendError(NOT_ALLOWED_HERE, str(exc)) from None
        return {"machine": machine, "event_ids": ids}

    def machine_power(self, action: str, *, dc: str | None = None, msb: str | None = None,
                      rack: str | None = None) -> dict:
        """A power loss (``loss``) or power back (``restore``) of one fault domain (exactly one of ``dc``, ``msb``
        ``<dc>/<msb>``, ``rack`` ``<dc>/<msb>/<rack>``): the Resource Broker's ``power_lost`` / ``power_restored``
        (processors/resourcebroker/processor.power_event). The document lists the machines changed and the UEs."""
        from processors.resourcebroker.processor import POWER_LOSS, POWER_RESTORE, power_event

        if action not in (POWER_LOSS, POWER_RESTORE):
            raise FrontendError(INVALID_REQUEST, f"action: expected {POWER_LOSS} or {POWER_RESTORE}, got {action!r}")
        given = [(level, v) for level, v in ((rbd.TARGET_DC, dc), (rbd.TARGET_MSB, msb), (rbd.TARGET_RACK, rack))
                 if v is not None]
        if len(given) != 1:
            raise FrontendError(INVALID_REQUEST, "give exactly one of dc, msb, rack"
                                + (f" (got {', '.join(level for level, _ in given)})" if given else ""))
        level, value = given[0]
        form = {rbd.TARGET_DC: "<dc>", rbd.TARGET_MSB: "<dc>/<msb>", rbd.TARGET_RACK: "<dc>/<msb>/<rack>"}[level]
        try:
            target = str(rbd.parse_target(f"{level}:{value}"))
        except rbd.BadTarget:
            raise FrontendError(INVALID_REQUEST, f"{level}: expected {form}, got {value!r}") from None
        self.require_broker()
        try:
            events = power_event(self.cfg, action, [target], registry=self.registry, skipped=self.skipped,
                                 principal=self.principal)
        except rbd.BadTarget:
            raise FrontendError(INVALID_REQUEST, f"{level}: no registered machine in {value!r}") from None
        statuses = [e for e in events if e.type == "MachinesStatusChanged"]
        return {"action": action, "target": target,
                "machines": sorted(m["machine_id"] for e in statuses for m in e.payload["machines"]),
                "unavailability_ids": sorted({e.payload["unavailability_id"] for e in events
                                              if e.type.startswith("Unavailability")}),
                "event_ids": [e.event_id for e in events]}

    def maintenance_plan(self, *, start_ms: int, duration_ms: int, deadline_ms: int | None = None,
                         machines: list[str] | None = None, rack: str | None = None, msb: str | None = None,
                         reason: str = "maintenance", dry_run: bool = False) -> dict:
        """Plan a maintenance; ``dry_run``: what it would do (processors/history/whatif.py), nothing produced."""
        from processors.opsplanner import planner as ops
        from processors.opsplanner.decide import Plan, PlanError

        self.require_broker()
        plan = Plan(start_ms=start_ms, duration_ms=duration_ms, deadline_ms=deadline_ms, machines=machines, rack=rack,
                    msb=msb, reason=reason)
        try:
            if dry_run:
                from processors.history import whatif

                return whatif.maintenance(self.cfg, self.registry, plan, int(time.time() * 1000),
                                          skipped=self.skipped)
            events = ops.plan_maintenance(self.cfg, self.registry, plan, int(time.time() * 1000),
                                          skipped=self.skipped, principal=self.principal)
        except PlanError as exc:
            raise FrontendError(INVALID_REQUEST, str(exc)) from None
        p = events[0].payload
        return {"unavailability_id": p["unavailability_id"], "machines": sorted(m for e in events
                                                                               for m in e.payload["machine_ids"]),
                "start_ms": p["start_ms"], "deadline_ms": p["deadline_ms"],
                "expected_duration_ms": p["expected_duration_ms"], "event_ids": [e.event_id for e in events]}

    def maintenance_end(self, unavailability_id: str) -> dict:
        from processors.opsplanner import planner as ops
        from processors.opsplanner.decide import PlanError

        self.require_broker()
        try:
            events = ops.end_maintenance(self.cfg, self.registry, unavailability_id, int(time.time() * 1000),
                                         skipped=self.skipped, principal=self.principal)
        except PlanError as exc:
            raise FrontendError(UNKNOWN_MAINTENANCE, str(exc)) from None
        machines = {m for e in events for m in e.payload.get("machine_ids", [e.payload.get("machine_id")]) if m}
        return {"unavailability_id": unavailability_id, "event_ids": [e.event_id for e in events],
                "machines": sorted(machines)}

    # -- the upper floors: per-dimension intents, the SRM, elastic loans (issue 15) --------------------------
    INTENT_TYPES = {"push": "PushIntentDeclared", "canary": "CanaryIntentDeclared", "size": "SizingIntentDeclared",
                    "resources": "ResourcesIntentDeclared"}

    def intent_declare(self, job: str, dimension: str, payload: Mapping[str, Any]) -> dict:
        """One per-dimension intent for ``job`` (push, canary, size, resources), checked by the intent rules
        (``processors/rules.py``) and keyed by the job's entitlement; the Job Control Plane reconciles it."""
        type_ = self.INTENT_TYPES.get(dimension)
        if type_ is None:
            raise FrontendError(INVALID_REQUEST, f"dimension: expected one of {', '.join(self.INTENT_TYPES)}, "
                                                 f"got {dimension!r}")
        if not isinstance(payload, Mapping):
            raise FrontendError(INVALID_REQUEST, "body: expected an object")
        ent = entitlement_of_job(job)  # a job the Job Control Plane does not know: its IntentRefused says so
        if payload.get("owner") not in (None, "", self.principal):  # an intent's owner is who declares it
            raise FrontendError(OWNER_NOT_CALLER, f"owner: an intent's owner is who declares it ({self.principal!r}), "
                                                  f"got {describe_value(payload.get('owner'))}")
        payload = {**payload, "job_id": job, "owner": self.principal}
        if type_ == "SizingIntentDeclared":  # a person's: the autoscaler's own come from the SRM alone
            payload = {"tasks": None, "autoscale": False, "min_tasks": None, "max_tasks": None,
                       "load_per_task": None, **payload, "source": "person", "decision": None}
        found = rules.intent_problems(type_, payload, ent, self.cfg.max_tasks_per_job)
        if found:
            raise FrontendError(INVALID_REQUEST, f"{type_}: {'; '.join(map(str, found))}")
        ev = self.event(type_, payload, ent, job)
        try:
            self.registry.encode(type_, ev.to_record())
        except Exception as exc:  # noqa: BLE001 - a field of the wrong type the rules do not name: say which
            raise FrontendError(INVALID_REQUEST, f"{type_}: {exc}") from None
        self.send([ev])
        return {"job": job, "intent": type_, "entitlement": ent, "event_id": ev.event_id}

    def intents(self, job: str | None = None) -> Any:
        """Who wants what of ``job`` and its reconciled spec (``job_intents_view``); without a job, every job that
        has intents."""
        from processors.jobcontrol.views import fold_intents

        self.require_broker()
        state = fold_intents(self.cfg, self.registry, skipped=self.skipped)
        if job is None:
            return [jd.job_intents_view(j) for _, j in sorted(state.jobs.items()) if j.intents]
        found = state.jobs.get(job)
        if found is None:
            raise FrontendError(UNKNOWN_JOB, f"no intents known for {job!r} (the Job Control Plane reads `intents`: "
                                             f"submit the job, then declare one)")
        return jd.job_intents_view(found)

    def intents_history(self, job: str) -> list[dict]:
        from processors.jobcontrol.views import history

        self.require_broker()
        return history(self.cfg, self.registry, job, skipped=self.skipped)

    def intents_ledger(self, job: str) -> list[dict]:
        """Every intent declared for ``job`` and what became of it: applied, refused (reason, field), declared."""
        from processors.jobcontrol.views import ledger

        self.require_broker()
        return ledger(self.cfg, self.registry, job, skipped=self.skipped)

    def srm(self, job: str) -> dict:
        """The job as the SRM sees it: policy, load, forecast, size, last change."""
        from processors.srm.views import fold_srm

        self.require_broker()
        found = fold_srm(self.cfg, self.registry, skipped=self.skipped).jobs.get(job)
        if found is None:
            raise FrontendError(UNKNOWN_JOB, f"the SRM knows nothing of {job!r} (no policy, size or load sample on "
                                             f"the log)")
        return sd.scaling_view(found)

    def srm_plan(self, job: str) -> dict:
        """What the SRM would decide for ``job`` now, with its rule and reason; writes nothing (a dry run)."""
        from processors.srm.views import dry_run

        self.require_broker()
        found = dry_run(self.cfg, self.registry, job, skipped=self.skipped)
        if found is None:
            raise FrontendError(UNKNOWN_JOB, f"the SRM knows nothing of {job!r} (no policy, size or load sample on "
                                             f"the log)")
        return found

    def srm_overview(self) -> list[dict]:
        """Every job the SRM knows: its picture, what it would decide now, its latest decision."""
        from processors.srm.views import overview

        self.require_broker()
        return overview(self.cfg, self.registry, skipped=self.skipped)

    def srm_decisions(self, job: str | None = None, entitlement: str | None = None) -> dict:
        from processors.srm.views import decisions

        self.require_broker()
        return decisions(self.cfg, self.registry, job, entitlement, skipped=self.skipped)

    def loans(self, entitlement: str | None = None) -> dict:
        """What is lent and being taken back (of ``entitlement``, as borrower or lender, if given)."""
        from processors.resourcebroker.loans_view import loans

        self.require_broker()
        return loans(self.cfg, self.registry, entitlement, skipped=self.skipped)

    def elasticity_set(self, entitlement: str, elastic: Any, max_borrowed: Any = 0, notice_ms: Any = 30_000,
                       lend_idle: Any = True) -> dict:
        """EntitlementElasticityChanged: whether ``entitlement`` may borrow idle machines (up to ``max_borrowed``,
        given back with ``notice_ms`` of notice) and whether its own idle quota may be lent."""
        payload = {"elastic": elastic, "max_borrowed_machines": max_borrowed, "revoke_notice_ms": notice_ms,
                   "lend_idle": lend_idle}
        found = rules.intent_problems("EntitlementElasticityChanged", payload, entitlement)
        if found:
            raise FrontendError(INVALID_REQUEST, "; ".join(map(str, found)))
        if entitlement not in {e["entitlement"] for e in self.entitlements()}:
            raise FrontendError(INVALID_REQUEST, f"entitlement: no entitlement {entitlement!r}", 404)
        ev = self.event("EntitlementElasticityChanged", payload, entitlement, entitlement)
        self.send([ev])
        return {"entitlement": entitlement, **payload, "event_id": ev.event_id}

    def maintenance_windows(self) -> list[dict]:
        """Planned maintenance on the log not ended yet (``UnavailabilityStarted`` of kind MAINTENANCE without its
        ``UnavailabilityEnded``): id, start, deadline, expected duration, reason, machines."""
        from streams import replay as rp

        self.require_broker()
        run = rp.replay(self.cfg, self.registry, rp.ReplayFilter(
            topics=("unavailability",), types=frozenset({"UnavailabilityStarted", "UnavailabilityEnded"})),
            skipped=self.skipped)
        return maintenance_windows(rec.event for rec in run)

    # -- the log ---------------------------------------------------------------------------------------------
    def replay(self, flt, progress=None) -> "Iterator":
        """The audit timeline (``streams.replay.replay``): a ``Replay`` to iterate once (``.stats`` after);
        ``progress`` as streams/progress.py says."""
        from streams import replay as rp

        self.require_broker()
        return rp.replay(self.cfg, self.registry, flt, skipped=self.skipped, progress=progress)

    def state_reader(self, kind: str, entitlement: str | None = None):
        """A ``streams.state.StateReader`` of ``kind`` (jobs, machines): ``catch_up`` then ``poll``/``follow``."""
        from streams.state import StateReader

        self.require_broker()
        return StateReader(self.cfg, self.registry, kind, entitlement, skipped=self.skipped)


def state_view(kind: str, ev: Event) -> dict:
    """What ``watch`` and the API's event streams show of one state record: a job's ``job_view``, a machine's
    ``machine_view``; ``deleted`` for a job that is gone."""
    from streams.state import machine_view

    if kind == "jobs":
        return job_view(ev)
    return machine_view(ev)


# -- the region at a moment (processors/history): Frontend's reads with ``at``, ``region``, ``explain`` -------------
def _now_ms() -> int:
    return int(time.time() * 1000)


def _iso(ms: int) -> str:
    from streams.replay import iso_time

    return iso_time(ms)


def moment(cfg: Config, registry: SchemaRegistry, value: str, field: str = "at") -> int:
    """A moment as the commands and the API take it (see ``moments.parse_moment``); a bad one is the front end's
    ``invalid_request`` naming ``field``."""
    from processors.history import moments

    try:
        return moments.parse_moment(str(value), _now_ms(),
                                    lambda t, p, o: moments.record_time(cfg, registry, t, p, o))
    except (moments.MomentError, ValueError) as exc:
        raise FrontendError(INVALID_REQUEST, f"{field}: {exc}") from None


def machine_views_at(cfg: Config, registry: SchemaRegistry, at: str, entitlement: str | None = None, *,
                     skipped: Skipped | None = None) -> list[dict]:
    """``machine list --at``: what ``machine list --json`` printed then (rows of ``state.machine_view``)."""
    from processors.history import moments
    from streams import state

    region, _ = moments.region_at(cfg, registry, moment(cfg, registry, at), skipped=skipped,
                                  scheduler_partitions=frozenset())  # machines are the allocator's: no job decided
    rows = [state.machine_view(ev) for ev in region.machine_states()]
    return [r for r in rows if r["entitlement"] == entitlement] if entitlement else rows


def job_state_at(cfg: Config, registry: SchemaRegistry, job: str, at: str, *, skipped: Skipped | None = None
                 ) -> Event:
    """``job status --at``: the job's JobStatePublished then (only its partition's jobs decided)."""
    from processors.history import moments

    at_ms = moment(cfg, registry, at)
    region, _ = moments.region_at(cfg, registry, at_ms, skipped=skipped,
                                  scheduler_partitions=moments.partitions_of(cfg, [entitlement_of_job(job)]))
    ev = region.job_states().get(job)
    if ev is None:
        raise FrontendError(UNKNOWN_JOB, f"unknown job {job!r} at {_iso(at_ms)} (not submitted yet, or stopped and "
                                         f"gone)")
    return ev


def region_doc(cfg: Config, registry: SchemaRegistry, at: str, *, skipped: Skipped | None = None) -> dict:
    """``ropewalk at TIME``: the whole region then (``overview``) and how it was made (``history``)."""
    from processors.history import moments

    at_ms = moment(cfg, registry, at)
    region, stats = moments.region_at(cfg, registry, at_ms, skipped=skipped)
    return {**overview(region, at_ms), "history": stats}


def explain_doc(cfg: Config, registry: SchemaRegistry, task: str, at: str | None = None,
                why_not: str | None = None, *, skipped: Skipped | None = None) -> dict:
    """``ropewalk explain TASK [--at TIME] [--why-not MACHINE]`` (``explain.explain``)."""
    from processors.history import explain as ex

    at_ms = None if at is None else moment(cfg, registry, at)
    try:
        return ex.explain(cfg, registry, task, at_ms, why_not=why_not, skipped=skipped)
    except ex.BadTaskId as exc:
        raise FrontendError(INVALID_REQUEST, f"task: {exc}") from None
    except ex.ExplainError as exc:
        raise FrontendError(UNKNOWN_TASK, str(exc)) from None


def overview(region, at_ms: int) -> dict[str, Any]:
    """The whole region at a moment: its machines (each as ``machine list --json`` shows it, and counted),
    entitlements, jobs with their tasks and where they ran (each as ``job status --json`` shows it)."""
    from streams import state

    machines = list(region.fold.machines.values())
    held = Counter(m.entitlement for m in machines if m.entitlement)
    return {
        "at_ms": at_ms, "at": _iso(at_ms),
        "machine_counts": {"total": len(machines),
                           "by_status": dict(sorted(Counter(m.status for m in machines).items())),
                           "free": sum(1 for m in machines if not m.entitlement),
                           "under_maintenance": sum(1 for m in machines if m.maintenance)},
        "machines": [state.machine_view(ev) for ev in region.machine_states()],
        "entitlements": [{"name": n, "quota": e.quota_machines, "held": held.get(n, 0), "machine_type": e.machine_type,
                          "dc_pin": e.dc_pin} for n, e in sorted(region.fold.entitlements.items())],
        "jobs": [{**(v := job_view(ev)), "running": sum(t["state"] == "RUNNING" for t in v["tasks"])}
                 for ev in region.job_states().values()],
    }


def maintenance_windows(events) -> list[dict]:
    """The maintenance windows not ended among ``events`` (UnavailabilityStarted/Ended in log order), by id. Pure."""
    open_: dict[str, dict] = {}
    for e in events:
        p = e.payload
        if e.type == "UnavailabilityStarted" and p["kind"] == "MAINTENANCE":
            open_[p["unavailability_id"]] = {
                "unavailability_id": p["unavailability_id"], "start_ms": p["start_ms"], "deadline_ms": p.get("deadline_ms"),
                "expected_duration_ms": p.get("expected_duration_ms"), "reason": p.get("reason") or "",
                "machines": sorted(p["machine_ids"])}
        elif e.type == "UnavailabilityEnded":
            open_.pop(p["unavailability_id"], None)
    return [open_[k] for k in sorted(open_)]
