"""What the Job Control Plane's views show, read from the log (``ropewalk intents show/list/history``, the API's
``/v1/jobs/{job}/intents``): ``intents`` folded with the Job Control Plane's own pure ``decide`` (its outputs
dropped; one full read of the topic per call), and its reconciliations replayed."""
from __future__ import annotations

from processors.jobcontrol import decide as jd


def fold_intents(cfg, registry, *, skipped=None) -> jd.JcpState:
    """The Job Control Plane's state: ``intents`` read to its end and folded by ``decide`` (outputs dropped)."""
    from processors.follower import fold_log

    return fold_log(cfg, registry, ("intents",), "jobcontrol-view", jd.CONSUMED,
                    lambda st, r: jd.decide(st, r.event, ("intents", r.partition, r.offset),
                                            max_tasks=cfg.max_tasks_per_job)[0], jd.JcpState(), skipped=skipped)


def history(cfg, registry, job: str, *, skipped=None) -> list[dict]:
    """Every JobSpecReconciled of ``job`` on the log (provenance, rules), and the Job Control Plane's refusals."""
    from streams import replay as rp

    rows = []
    for rec in rp.replay(cfg, registry, rp.ReplayFilter(job=job, topics=("intents",)), skipped=skipped):
        e = rec.event
        if e.type == "JobSpecReconciled":
            rows.append({"generation": e.payload["generation"], "event_id": e.event_id, "at_ms": e.timestamp_ms,
                         "offset": rec.offset, **{k: e.payload[k] for k in ("tasks", "stable_version", "push",
                                                                              "canary", "provenance", "rules")}})
        elif e.type == "IntentRefused" and e.producer == jd.PRODUCER:
            rows.append({"refused": e.payload["intent_type"], "reason": e.payload["reason"],
                         "message": e.payload["message"], "offset": rec.offset, "at_ms": e.timestamp_ms})
    return rows
