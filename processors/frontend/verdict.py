"""The scheduler's verdict on one intent: accepted, or refused with the reason.

The scheduler answers an intent it refuses with an ``IntentRefused`` on ``intents`` (``intent_event_id`` = the
intent's id) and publishes the job's state on ``state.jobs`` whenever an intent changes what it shows, with the
intent's id as ``causation_id`` (processors/scheduler/README.md). ``verdict_of`` reads one such record (pure);
``VerdictWatch`` positions a reader at the end of the two partitions the answer can land on (the intent's
entitlement's partition of ``intents``, the job's of ``state.jobs``) BEFORE the intent is sent, so no answer is
missed, then reads until one comes or the wait is over.

    with VerdictWatch(cfg, registry, intent, job_id) as watch:
        producer.send(intent); producer.flush()
        got = watch.wait(30.0)          # Verdict or None (no answer in time)

An identical resubmission of a live job is a no-op for the scheduler and gets no answer (``None``: pending). A
refusal that concerns an existing job also changes its published ``last_reason``, so a JobStatePublished caused
by the intent whose ``last_reason`` names an intent refusal is not taken for an acceptance: the watch waits up to
``GRACE_S`` more for the IntentRefused (both come from one decision of the scheduler).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from processors.scheduler import reasons as s
from processors.scheduler.lifecycle import JOB_REJECTED
from streams.events import Event
from streams.partitioner import partition_for
from streams.topics import Topics

ACCEPTED, REFUSED = "accepted", "refused"  # service.ACCEPTED / REFUSED
GRACE_S = 3.0


def _intent_refusals() -> frozenset[str]:
    return frozenset({s.REASON_DUPLICATE_JOB_ID, s.REASON_UNKNOWN_ENTITLEMENT, s.REASON_UNKNOWN_JOB,
                      s.REASON_INVALID_SPEC, s.REASON_TOO_MANY_TASKS, s.REASON_INVALID_ENTITLEMENT,
                      s.REASON_JOB_NOT_ACTIVE, s.REASON_STALE_SPEC_VERSION, s.REASON_ENTITLEMENT_MISMATCH})


INTENT_REFUSALS = _intent_refusals()  # the reasons of IntentRefused (processors/scheduler/README.md)


@dataclass(frozen=True)
class Verdict:
    verdict: str  # ACCEPTED or REFUSED
    reason: str  # the refusal's reason constant ("" when accepted)
    message: str
    state: str | None  # the job's state the scheduler published, when it did
    final: bool = True  # False: an acceptance that an IntentRefused of the same decision may still contradict


def verdict_of(intent_id: str, ev: Event) -> Verdict | None:
    """The verdict ``ev`` gives on the intent ``intent_id``, or None if it is not about it. Pure."""
    p = ev.payload
    if ev.type == "IntentRefused" and p["intent_event_id"] == intent_id:
        return Verdict(REFUSED, p["reason"], p.get("message") or "", None)
    if ev.type == "JobStatePublished" and ev.causation_id == intent_id:
        reason, _, message = (p.get("last_reason") or "").partition(": ")
        if p["state"] == JOB_REJECTED:  # a job the scheduler rejected (JobStatePublished.state)
            return Verdict(REFUSED, reason, message, p["state"])
        return Verdict(ACCEPTED, "", "", p["state"], final=reason not in INTENT_REFUSALS)
    return None


class VerdictWatch:
    def __init__(self, cfg, registry, intent: Event, job_id: str, *, intents_partition: int | None = None):
        """``intents_partition``: where the intent goes, and the scheduler's refusal with it (the partition map's
        partition of its entitlement; default: its key's hash partition)."""
        from streams.clients import EventConsumer, key_of  # noqa: PLC0415 - start-up: confluent-kafka (~35 ms)

        topics = Topics(cfg.topic_prefix, cfg.partitions)
        self.intent = intent
        if intents_partition is None:
            intents_partition = partition_for(key_of("intents", intent).encode(), topics.partitions_of("intents"))
        where = [(topics.name("intents"), intents_partition),
                 (topics.name("state.jobs"), partition_for(job_id.encode(), topics.partitions_of("state.jobs")))]
        self.consumer = EventConsumer(cfg, registry, [t for t, _ in where], name="verdict",
                                      start_offsets={}, types=("IntentRefused", "JobStatePublished"))
        ends = self.consumer.high_watermarks(where)  # the answer comes after what is there now
        self.consumer.assign(ends, only=where)

    def wait(self, timeout_s: float) -> Verdict | None:
        deadline = time.monotonic() + timeout_s
        tentative: Verdict | None = None
        while (left := deadline - time.monotonic()) > 0:
            for rec in self.consumer.poll(500, min(0.5, left), linger_s=0.0):
                got = verdict_of(self.intent.event_id, rec.event)
                if got is not None and (got.final or got.verdict == REFUSED):
                    return got
                if got is not None and tentative is None:
                    tentative, deadline = got, min(deadline, time.monotonic() + GRACE_S)
        return tentative

    def close(self) -> None:
        self.consumer.close()

    def __enter__(self) -> "VerdictWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
