"""What the Job Control Plane's views show, read from the log (``ropewalk intents show/list/history``, the API's
``/v1/jobs/{job}/intents``): ``intents`` folded with the Job Control Plane's own pure ``decide`` (its outputs
dropped; one full read of the topic per call), and its reconciliations replayed."""
from __future__ import annotations

import re

from processors.follower import fold_log
from processors.jobcontrol import decide as jd
from streams import replay as rp


def fold_intents(cfg, registry, *, skipped=None) -> jd.JcpState:
    """The Job Control Plane's state: ``intents`` read to its end and folded by ``decide`` (outputs dropped)."""
    return fold_log(cfg, registry, ("intents",), "jobcontrol-view", jd.CONSUMED,
                    lambda st, r: jd.decide(st, r.event, ("intents", r.partition, r.offset),
                                            max_tasks=cfg.max_tasks_per_job, gc_ms=int(cfg.job_gc_s * 1000))[0],
                    jd.JcpState(), skipped=skipped)


def history(cfg, registry, job: str, *, skipped=None) -> list[dict]:
    """Every JobSpecReconciled of ``job`` on the log (provenance, rules), and the Job Control Plane's refusals."""
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


# Outcomes of a declared intent (``ledger``).
APPLIED = "applied"  # a JobSpecReconciled names it in its provenance
REFUSED = "refused"  # an IntentRefused of the Job Control Plane answers it
DECLARED = "declared"  # neither (yet): not reconciled, or it changed nothing in the spec


def ledger(cfg, registry, job: str, *, skipped=None) -> list[dict]:
    """Every per-dimension intent declared for ``job`` on the log, with what became of it (``ledger_rows``)."""
    run = rp.replay(cfg, registry, rp.ReplayFilter(job=job, topics=("intents",)), skipped=skipped)
    return ledger_rows((rec.offset, rec.event) for rec in run)


def refused_field(message: str) -> str | None:
    """The field a refusal's message names (``tasks: ...``, ``resources.cpu_millicores: ...``; the schema's
    IntentRefused.message form), or None. Pure."""
    m = re.match(r"(?:[A-Z][A-Za-z]+: )?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*|\[\d+\])*): ", message)
    return m.group(1) if m else None


def ledger_rows(records) -> list[dict]:
    """``records``: (offset, event) of one job's ``intents`` in log order. One row per per-dimension intent
    (push, canary, sizing, resources) in declaration order: who declared what, and its outcome — ``applied`` (by
    which reconciliation's generation), ``refused`` (the reason, the field, the message), or ``declared``. Pure."""
    rows: dict[str, dict] = {}
    for offset, e in records:
        p = e.payload
        if e.type in jd.INTENT_DIMENSION:
            rows[e.event_id] = {"event_id": e.event_id, "type": e.type, "dimension": jd.INTENT_DIMENSION[e.type],
                                "owner": p.get("owner") or e.producer, "at_ms": e.timestamp_ms, "offset": offset,
                                "wants": _wants(e.type, p), "outcome": DECLARED, "generation": None,
                                "reason": None, "field": None, "message": None}
        elif e.type == "IntentRefused" and e.producer == jd.PRODUCER and p["intent_event_id"] in rows:
            rows[p["intent_event_id"]].update(outcome=REFUSED, reason=p["reason"], message=p["message"],
                                              field=refused_field(p["message"]))
        elif e.type == "JobSpecReconciled":
            for prov in p.get("provenance") or ():
                row = rows.get(prov.get("intent_event_id"))
                if row is not None and row["outcome"] == DECLARED:
                    row.update(outcome=APPLIED, generation=p["generation"])
    return list(rows.values())


def _wants(type_: str, p) -> str:
    """What an intent asks for, in a few words."""
    if type_ == "PushIntentDeclared":
        return f"{p['percent']}% on {p.get('label') or ' '.join(p['command'])}" + (
            f" (steps {','.join(map(str, p['steps']))})" if p.get("steps") else "")
    if type_ == "CanaryIntentDeclared":
        if p.get("action") == jd.START:
            return f"canary of {p.get('count')} on {p.get('label') or ' '.join(p.get('command') or ())}"
        return f"canary {p.get('action')}"
    if type_ == "SizingIntentDeclared":
        if p.get("autoscale"):
            return f"autoscale {p.get('min_tasks')}..{p.get('max_tasks')}, {p.get('load_per_task')} load per task"
        if p.get("tasks") is None:
            return "release the size"
        d = p.get("decision")
        return f"{p['tasks']} tasks" + (f" ({d['direction']}: {d['rule']})" if d else "")
    r = p.get("resources") or p
    return f"{r.get('cpu_millicores')} millicores, {r.get('memory_mib')} MiB"
