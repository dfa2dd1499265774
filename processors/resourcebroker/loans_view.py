"""What the loans view shows, read from the log (``ropewalk loans show``, the API's ``/v1/loans``): the topics the
lender reads, folded with its own pure ``loans.apply`` (no deciding), then ``loans.view`` at the time of the call;
and the loan events themselves, replayed (``history``)."""
from __future__ import annotations

import time

from processors.resourcebroker import loans as ln


def fold_loans(cfg, registry, *, skipped=None) -> ln.LoanBook:
    from processors.follower import fold_log

    return fold_log(cfg, registry, ln.TOPICS, "loans-view", ln.CONSUMED, lambda b, r: ln.apply(b, r.event)[0],
                    ln.LoanBook(), skipped=skipped)


def loans(cfg, registry, entitlement: str | None = None, *, skipped=None, now_ms: int | None = None) -> dict:
    """``loans.view`` of the log as it is: what is lent, what is being taken back, the picture of the next tick;
    and every return on the log with how long it took against its bound. With ``entitlement``: only what concerns
    it (loans it borrows or backs, its revocations, returns, elasticity and demand)."""
    from streams import replay as rp

    doc = ln.view(fold_loans(cfg, registry, skipped=skipped), now_ms or int(time.time() * 1000))
    doc["returns"] = [dict(r.event.payload, borrower=r.event.entitlement)
                      for r in rp.replay(cfg, registry, rp.ReplayFilter(topics=("loans",)), skipped=skipped)
                      if r.event.type == "LoanReturned"]
    doc["returned_p99_ms"] = p99(r["took_ms"] for r in doc["returns"])
    return doc if entitlement is None else only(doc, entitlement)


def only(doc: dict, entitlement: str) -> dict:
    """``doc`` narrowed to what concerns ``entitlement``. Pure."""
    return {**doc, "loans": [x for x in doc["loans"] if entitlement in (x["borrower"], x["lender"])],
            "revocations": [r for r in doc["revocations"] if r["borrower"] == entitlement],
            "returns": [r for r in doc["returns"] if r["borrower"] == entitlement],
            "elastic": {k: v for k, v in doc["elastic"].items() if k == entitlement},
            "owner_demand": {k: v for k, v in doc["owner_demand"].items() if k == entitlement},
            "borrower_demand": {k: v for k, v in doc["borrower_demand"].items() if k == entitlement},
            "returned_p99_ms": p99(r["took_ms"] for r in doc["returns"] if r["borrower"] == entitlement)}


def p99(values) -> int | None:
    """The 99th percentile (nearest rank) of ``values``; None of none."""
    v = sorted(values)
    return v[min(len(v) - 1, int(0.99 * len(v)))] if v else None
