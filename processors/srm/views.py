"""What the SRM's views show, read from the log (``ropewalk srm show/decisions``, the API's ``/v1/jobs/{job}/srm``
and ``/v1/srm/decisions``): ``intents`` and ``metrics`` folded with the SRM's own pure ``decide`` (no deciding),
and its decisions replayed with their inputs and forecast."""
from __future__ import annotations

from processors.follower import fold_log
from processors.srm import decide as sd
from streams import replay as rp


def fold_srm(cfg, registry, *, skipped=None) -> sd.SrmState:
    return fold_log(cfg, registry, ("intents", "metrics"), "srm-view", sd.CONSUMED,
                    lambda st, r: sd.decide(st, r.event, live=False)[0], sd.SrmState(), skipped=skipped)


def decisions(cfg, registry, job: str | None = None, entitlement: str | None = None, *, skipped=None) -> dict:
    """Every sizing decision of the SRM on the log (of ``job``, or of ``entitlement``'s jobs), and how often it
    reversed direction in an hour of the load signal's clock."""
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


def dry_run(cfg, registry, job: str, *, skipped=None) -> dict | None:
    """What the SRM would decide for ``job`` now (``decide.dry_run``), producing nothing; None for a job it knows
    nothing of."""
    found = fold_srm(cfg, registry, skipped=skipped).jobs.get(job)
    return None if found is None else sd.dry_run(found)


def overview(cfg, registry, *, skipped=None) -> list[dict]:
    """Every job the SRM knows, one row each (the web UI's SRM page): its picture (``scaling_view``), what it would
    decide now (``dry_run``) and its latest decision on the log (None before its first)."""
    latest = {}
    for row in decisions(cfg, registry, skipped=skipped)["decisions"]:
        latest[row["job"]] = row
    return [{**sd.scaling_view(j), "now": sd.dry_run(j), "last_decision": latest.get(j.job_id)}
            for _, j in sorted(fold_srm(cfg, registry, skipped=skipped).jobs.items())]
