"""What the SRM's views show, read from the log (``ropewalk srm show/decisions``, the API's ``/v1/jobs/{job}/srm``
and ``/v1/srm/decisions``): ``intents`` and ``metrics`` folded with the SRM's own pure ``decide`` (no deciding),
and its decisions replayed with their inputs and forecast."""
from __future__ import annotations

from processors.srm import decide as sd


def fold_srm(cfg, registry, *, skipped=None) -> sd.SrmState:
    from processors.follower import fold_log

    return fold_log(cfg, registry, ("intents", "metrics"), "srm-view", sd.CONSUMED,
                    lambda st, r: sd.decide(st, r.event, live=False)[0], sd.SrmState(), skipped=skipped)


def decisions(cfg, registry, job: str | None = None, entitlement: str | None = None, *, skipped=None) -> dict:
    """Every sizing decision of the SRM on the log (of ``job``, or of ``entitlement``'s jobs), and how often it
    reversed direction in an hour of the load signal's clock."""
    from streams import replay as rp

    run = rp.replay(cfg, registry, rp.ReplayFilter(job=job, entitlement=entitlement, topics=("intents",)),
                    skipped=skipped)
    rows = [{"job": r.event.payload["job_id"], "tasks": r.event.payload["tasks"], "event_id": r.event.event_id,
             "offset": r.offset, **r.event.payload["decision"]}
            for r in run if r.event.type == "SizingIntentDeclared" and r.event.producer == sd.PRODUCER]
    by_job: dict[str, list[dict]] = {}
    for r in rows:
        by_job.setdefault(r["job"], []).append(r)
    flips = {j: sd.reversals(rs) for j, rs in by_job.items()}
    return {"decisions": rows, "reversals": flips,
            "most_reversals_in_an_hour": max((sd.most_in_window(f, 3600_000) for f in flips.values()), default=0)}
