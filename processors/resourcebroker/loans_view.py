"""What the loans view shows, read from the log (``ropewalk loans show``, the API's ``/v1/loans``): the topics the
lender reads, folded with its own pure ``loans.apply`` (no deciding), then ``loans.view`` at the time of the call;
and the loan events themselves, replayed (``history``)."""
from __future__ import annotations

import time
from collections.abc import Collection

from processors.follower import fold_log
from processors.resourcebroker import loans as ln
from streams import replay as rp


def fold_loans(cfg, registry, *, skipped=None) -> ln.LoanBook:
    return fold_log(cfg, registry, ln.TOPICS, "loans-view", ln.CONSUMED, lambda b, r: ln.apply(b, r.event)[0],
                    ln.LoanBook(), skipped=skipped)


def loans(cfg, registry, entitlement: str | None = None, *, skipped=None, now_ms: int | None = None) -> dict:
    """``loans.view`` of the log as it is: what is lent, what is being taken back, the picture of the next tick;
    and every return on the log with how long it took against its bound. With ``entitlement``: only what concerns
    it (loans it borrows or backs, its revocations, returns, elasticity and demand)."""
    doc = ln.view(fold_loans(cfg, registry, skipped=skipped), now_ms or int(time.time() * 1000))
    events = [r.event for r in rp.replay(cfg, registry, rp.ReplayFilter(topics=("loans",)), skipped=skipped)]
    doc["returns"] = [dict(e.payload, borrower=e.entitlement) for e in events if e.type == "LoanReturned"]
    doc["returned_p99_ms"] = p99(r["took_ms"] for r in doc["returns"])
    doc["history"] = history(events)
    return doc if entitlement is None else only(doc, entitlement)


def history(events) -> list[dict]:
    """The loan events in log order, one row each (the web UI's loans page): what happened (``granted``,
    ``revoked``, ``returned``), when, the borrower, the lender(s), the machines (a count lent; the machines taken
    back or returned), the deadline of a revocation's notice, and why. Pure."""
    rows = []
    for e in events:
        p = e.payload
        if e.type == "LoanGranted":
            rows.append({"kind": "granted", "at_ms": e.timestamp_ms, "id": p["loan_id"], "borrower": e.entitlement,
                         "lenders": [p["lender"]], "machines": p["machines"], "machine_ids": [],
                         "deadline_ms": None, "reason": p["reason"]})
        elif e.type == "LoanRevoked":
            rows.append({"kind": "revoked", "at_ms": e.timestamp_ms, "id": p["revocation_id"],
                         "borrower": e.entitlement, "lenders": list(p["lenders"]),
                         "machines": len(p["machine_ids"]) + p["unused_machines"], "machine_ids": list(p["machine_ids"]),
                         "deadline_ms": p["deadline_ms"], "reason": p["reason"]})
        elif e.type == "LoanReturned":
            rows.append({"kind": "returned", "at_ms": p["returned_at_ms"], "id": p["revocation_id"],
                         "borrower": e.entitlement, "lenders": [], "machines": 1, "machine_ids": [p["machine_id"]],
                         "deadline_ms": None,
                         "reason": f"back in the free pool {p['took_ms']} ms after its revocation (bound "
                                   f"{p['bound_ms']} ms)"})
    return rows


def only(doc: dict, entitlement: str | Collection[str]) -> dict:
    """``doc`` narrowed to what concerns ``entitlement`` (one, or any of several: what a user may see). Pure."""
    ents = {entitlement} if isinstance(entitlement, str) else set(entitlement)
    returns = [r for r in doc["returns"] if r["borrower"] in ents]
    return {**doc, "loans": [x for x in doc["loans"] if ents & {x["borrower"], x["lender"]}],
            "revocations": [r for r in doc["revocations"] if r["borrower"] in ents],
            "returns": returns,
            "history": [h for h in doc.get("history", ()) if ents & {h["borrower"], *h["lenders"]}],
            "elastic": {k: v for k, v in doc["elastic"].items() if k in ents},
            "owner_demand": {k: v for k, v in doc["owner_demand"].items() if k in ents},
            "borrower_demand": {k: v for k, v in doc["borrower_demand"].items() if k in ents},
            "returned_p99_ms": p99(r["took_ms"] for r in returns)}


def p99(values) -> int | None:
    """The 99th percentile (nearest rank) of ``values``; None of none."""
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else None
