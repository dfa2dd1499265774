"""The scheduler's records: its state (``model.py``) as plain JSON-able data, a faust table value (MappingProxyType
does not pickle), and back. ``job_from_record(job_to_record(job)) == job``; ``store.py`` keeps a job as a header and
chunks of these task records. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any

from processors.scheduler import versions as vs
from processors.scheduler.model import Job, Maintenance, Pairs, Spec, Task, Terms
from processors.taskcontrol import limiter

_TASK_FIELDS = tuple(f.name for f in fields(Task) if f.init)


def _pairs(pairs: Pairs) -> list[list[str]]:
    return [list(p) for p in pairs]


def terms_record(t: Terms | None) -> dict | None:
    return None if t is None else {"cpu": t.cpu, "mem": t.mem, "requirements": _pairs(t.requirements)}


def terms_of(r: Mapping[str, Any] | None) -> Terms | None:
    return None if r is None else Terms(r["cpu"], r["mem"], tuple(map(tuple, r["requirements"])))


def spec_record(s: Spec) -> dict:
    return {"name": s.name, "command": list(s.command), "cpu": s.cpu, "mem": s.mem,
            "requirements": _pairs(s.requirements), "spread": s.spread, "max_unavailable": s.max_unavailable,
            "env": _pairs(s.env), "controller": s.controller}


def spec_of(r: Mapping[str, Any]) -> Spec:
    return Spec(name=r["name"], command=tuple(r["command"]), cpu=r["cpu"], mem=r["mem"],
                requirements=tuple(map(tuple, r["requirements"])), spread=r["spread"],
                max_unavailable=r["max_unavailable"], env=tuple(map(tuple, r["env"])), controller=r.get("controller"))


def job_to_record(job: Job, previous: tuple[Job, Mapping[str, Any]] | None = None) -> dict:
    """``job`` as plain JSON-able data (a faust table value); ``job_from_record`` reads it back equal.

    ``previous``: an earlier version of the job and its record (one made from the other); the record of every task
    that is still the same ``Task`` object is reused as it is instead of built again (a decision changes a few
    tasks of a job: at 1,000 tasks this is most of the cost of writing the job back)."""
    known: dict[int, tuple[Task, dict]] = {}
    if previous is not None:
        known = {id(t): (t, r) for t, r in zip(previous[0].tasks.values(), previous[1]["tasks"])}
    tasks = []
    for t in job.tasks.values():
        hit = known.get(id(t))
        if hit is not None and hit[0] is t:
            tasks.append(hit[1])
            continue
        r = {name: getattr(t, name) for name in _TASK_FIELDS}
        r["terms"], r["request_terms"] = terms_record(t.terms), terms_record(t.request_terms)
        tasks.append(r)
    origin = [*job.origin[:3], spec_record(job.origin[3])] if job.origin else []
    return {"id": job.id, "entitlement": job.entitlement, "spec": spec_record(job.spec),
            "spec_version": job.spec_version, "desired": job.desired, "status": job.status, "tasks": tasks,
            "last_reason": job.last_reason, "last_ignored": job.last_ignored, "updating": job.updating,
            "requests": job.requests, "free_request_id": job.free_request_id, "deleted": job.deleted,
            "origin": origin, "seen": list(job.seen), "ops": job.ops, "ops_open": job.ops_open,
            "bucket": limiter.bucket_record(job.bucket), "throttled": list(job.throttled), "tc_seq": job.tc_seq,
            "tc_outstanding": job.tc_outstanding, "tc_asked": list(job.tc_asked), "tc_asked_ms": job.tc_asked_ms,
            "tc_completed": list(job.tc_completed), "tc_sent_completed": list(job.tc_sent_completed),
            "tc_sent_unhealthy": list(job.tc_sent_unhealthy),
            "tc_notices": [[u, list(ts), s, d, dur] for u, ts, s, d, dur in job.tc_notices],
            "tc_notice_new": job.tc_notice_new,
            "maint": [[u, list(ms), s, d, e] for u, ms, s, d, e in job.maint], "incarnation": job.incarnation,
            "submission": job.submission, "mix": vs.mix_record(job.mix), "generation": job.generation,
            "vacating": list(job.vacating), "ended_ms": job.ended_ms, "parts": job.parts,
            "free_asked_ms": job.free_asked_ms}


def job_from_record(r: Mapping[str, Any]) -> Job:
    tasks = {}
    for tr in r["tasks"]:
        t = Task(**{**tr, "terms": terms_of(tr["terms"]), "request_terms": terms_of(tr["request_terms"]),
                    "early_reports": tuple(tr.get("early_reports", ()))})
        tasks[t.id] = t
    o = r["origin"]
    return Job(id=r["id"], entitlement=r["entitlement"], spec=spec_of(r["spec"]), spec_version=r["spec_version"],
               desired=r["desired"], status=r["status"], tasks=MappingProxyType(tasks), last_reason=r["last_reason"],
               last_ignored=r["last_ignored"], updating=r["updating"], requests=r["requests"],
               free_request_id=r["free_request_id"], deleted=r["deleted"],
               origin=(*o[:3], spec_of(o[3])) if o else (), seen=tuple(r["seen"]), ops=r.get("ops", 0),
               ops_open=r.get("ops_open", 0), bucket=limiter.bucket_of(r.get("bucket")),
               throttled=tuple(r.get("throttled", ())), tc_seq=r.get("tc_seq", 0),
               tc_outstanding=r.get("tc_outstanding", False), tc_asked=tuple(r.get("tc_asked", ())),
               tc_asked_ms=r.get("tc_asked_ms"), tc_completed=tuple(r.get("tc_completed", ())),
               tc_sent_completed=tuple(r.get("tc_sent_completed", ())),
               tc_sent_unhealthy=tuple(r.get("tc_sent_unhealthy", ())),
               tc_notices=tuple((n[0], tuple(n[1]), n[2], n[3], n[4] if len(n) > 4 else None)
                                for n in r.get("tc_notices", ())),
               tc_notice_new=r.get("tc_notice_new", False),
               maint=tuple(Maintenance(u, tuple(ms), s, d, e) for u, ms, s, d, e in r.get("maint", ())),
               incarnation=r.get("incarnation", 1), submission=r.get("submission", ""),
               mix=vs.mix_from_record(r.get("mix")), generation=r.get("generation", 0),
               vacating=tuple(r.get("vacating", ())), ended_ms=r.get("ended_ms"), parts=r.get("parts", 0),
               free_asked_ms=r.get("free_asked_ms"))

