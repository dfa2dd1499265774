"""Shadow replay: the recorded inputs of a window decided again, in memory, under another placement policy, and
what changed. ``ropewalk shadow --since T [--until T] --policy P``.

    report = shadow(cfg, registry, since_ms, until_ms, policy)

The region at ``since`` (``moments.region_at``), then ``Region.start_shadow`` (see region.py: what is recorded and
kept, what is decided again), the log read on to ``until``. Nothing is produced and nothing live is touched.

**The diff** (``compare``), per request id (``<job>:v<version>:r<n>``, derived ids: the same request in both):

* ``decisions``: each allocator decision whose events differ from the recorded ones (event ids and payloads;
  ``commit_attempts`` is left out: it counts Redis conflicts between allocators, which a shadow has none of), and
  requests only one side decided;
* both sides' events are compared **as the log holds them** (``same``): the recorded ones were written with their
  type's schema and read back, so the shadow's are too (``as_logged``) before a difference is called one. A field
  the schema gives a default and a decision leaves out (the ``proof`` of a report in a scheduler's TaskStatesChanged:
  null, only agents prove theirs) is that default on the log; compared in memory, every such event would differ;
* ``scheduler``: the scheduler's outputs (commands, requests, task transitions, discovery, TaskControl requests,
  refusals; not its state records, which the live shard coalesces per batch) that differ, by event id;
* ``totals`` of each side: requests decided, tasks placed, moves (a task placed again on another machine),
  rejections by reason (events and tasks), machines with tasks at ``until`` (all and per entitlement), and spread
  per job at ``until`` (tasks per MSB); the jobs whose spread differs are listed.

With the live policy the diff is empty when the replay reproduces the log: that is the determinism check, and the
baseline that any other policy's run is compared against (when a policy changes nothing, neither does its diff).
For another policy a baseline run (live policy) is made first and reports how far the replay reproduces the log
(``determinism``).

**Policies** (``policy_of``): ``live``; ``key=value[;key=value]`` settings, ``scores=NAME,NAME,...`` (from
``placement.SCORE_CHOICES``) and ``spread=dc|msb|rack``; or a Python module ``pkg.mod[:NAME]`` holding a
``placement.Policy`` (``NAME`` defaults to ``POLICY``).
"""
from __future__ import annotations

import importlib
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from infra.config import Config
from processors.allocator.placement import LIVE, SCORE_CHOICES, SPREAD_LEVELS, Policy
from processors.history import moments, reader
from processors.history.region import Region, ShadowLog
from streams.deadletter import Skipped
from streams.events import Event
from streams.serde import SchemaRegistry

STEP_MS = 10_000  # the shadow advances in steps of this much log time while it reads
SHOWN = 50  # differing decisions listed at most (all are counted)
STATE_TYPES = frozenset({"JobStatePublished", "JobTasksPublished"})


class PolicyError(ValueError):
    pass


def policy_of(spec: str) -> Policy:
    """A placement policy from ``live``, settings ``scores=a,b;spread=rack``, or ``module[:NAME]``."""
    spec = spec.strip()
    if spec in ("", "live"):
        return LIVE
    if "=" in spec:
        scores, spread = LIVE.scores, None
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            key, _, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if key == "scores":
                names = [n.strip() for n in value.split(",") if n.strip()]
                unknown = [n for n in names if n not in SCORE_CHOICES]
                if not names or unknown:
                    raise PolicyError(f"--policy scores: unknown score {unknown[0] if unknown else '(none)'!r}; "
                                      f"known: {', '.join(SCORE_CHOICES)}")
                scores = tuple((n, SCORE_CHOICES[n]) for n in names)
            elif key == "spread":
                if value not in SPREAD_LEVELS:
                    raise PolicyError(f"--policy spread: expected one of {', '.join(SPREAD_LEVELS)}, got {value!r}")
                spread = value
            else:
                raise PolicyError(f"--policy: unknown setting {key!r}; known: scores, spread")
        return Policy(name=spec, scores=scores, spread=spread)
    module, _, name = spec.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise PolicyError(f"--policy {spec}: cannot import module {module!r} ({exc})") from None
    found = getattr(mod, name or "POLICY", None)
    if not isinstance(found, Policy):
        raise PolicyError(f"--policy {spec}: {module}.{name or 'POLICY'} is not a placement.Policy")
    return found


# -- running --------------------------------------------------------------------------------------------------
def run(cfg: Config, registry: SchemaRegistry, since_ms: int, until_ms: int, policy: Policy, *,
        skipped: Skipped | None = None
        ) -> tuple[Region, ShadowLog, Mapping[str, str], dict[str, Any]]:
    """One shadow run over ``(since, until]``: the region at its end, what it decided, the placements at since."""
    t0 = time.monotonic()
    if not isinstance(skipped, reader.Once):  # the log up to since is read twice: count what cannot be decoded once
        skipped = reader.Once(skipped)
    region, stats = moments.region_at(cfg, registry, since_ms, skipped=skipped)
    at_since, log = begin(region, policy)
    stream = reader.merged(cfg, registry, region.positions, skipped=skipped, stats=stats)
    try:
        replay(region, stream, until_ms)
    finally:
        stream.close()
    stats["seconds"] = round(time.monotonic() - t0, 3)
    return region, log, at_since, stats


def begin(region: Region, policy: Policy) -> tuple[dict[str, str], ShadowLog]:
    """Start the shadow on ``region`` (advanced to the window's start): the placements then, and its log. Read the
    log again from ``region.positions`` (``replay``)."""
    at_since = dict(region.fold.placement)
    return at_since, region.start_shadow(policy)


def replay(region: Region, records: Iterable[tuple[Event, tuple[str, int, int]]], until_ms: int) -> Region:
    """Pure: the shadow ``region`` reads ``records`` (the log in merged order from its positions) to ``until_ms``."""
    for ev, pos in records:
        region.read(ev, pos)
        if ev.timestamp_ms > until_ms + region.lookahead_ms:
            break
        step = min(ev.timestamp_ms - region.lookahead_ms, until_ms)
        if region.cut is None or step > region.cut + STEP_MS:
            region.advance(step)
    region.advance(until_ms)
    return region


def shadow(cfg: Config, registry: SchemaRegistry, since_ms: int, until_ms: int, policy: Policy, *,
           skipped: Skipped | None = None) -> dict[str, Any]:
    """The report of ``ropewalk shadow``: the diff of ``policy``'s run against the log, and (for another policy
    than the live one) how far the live policy's run reproduces the log."""
    skipped = reader.Once(skipped)  # both runs read the window: each undecodable record is said once
    base_region, base, at_since, base_stats = run(cfg, registry, since_ms, until_ms, LIVE, skipped=skipped)
    baseline = compare(base, base_region, at_since, until_ms, registry)
    doc: dict[str, Any] = {"since_ms": since_ms, "until_ms": until_ms, "policy": policy.describe(),
                           "baseline": {"policy": LIVE.describe(), **_headline(baseline), "seconds": base_stats["seconds"]}}
    if policy.live:
        doc.update(baseline)
        return doc
    region, log, at_since, stats = run(cfg, registry, since_ms, until_ms, policy, skipped=skipped)
    doc.update(compare(log, region, at_since, until_ms, registry))
    doc["seconds"] = stats["seconds"]
    return doc


def _headline(diff: Mapping[str, Any]) -> dict[str, Any]:
    return {"decisions_compared": diff["decisions_compared"], "decisions_differ": diff["decisions_differ"],
            "scheduler_events_compared": diff["scheduler_events_compared"],
            "scheduler_events_differ": diff["scheduler_events_differ"], "reproduces_the_log": diff["empty"]}


# -- the diff ---------------------------------------------------------------------------------------------------
def as_logged(event: Event, registry: SchemaRegistry) -> Event | None:
    """``event`` as a reader of the log gets it: written with its type's schema, read back (the fields the decision
    left out hold the schema's defaults); None if it cannot be written (the live producer would have refused it)."""
    try:
        type_, data = registry.decode(registry.encode(event.type, event.to_record(registry.reader(event.type).version)))
    except (KeyError, ValueError, TypeError):  # an unknown type, an invalid record (InvalidEvent, DecodeError)
        return None
    return Event.from_record(type_, data)


def same(recorded: list[Event], decided: list[Event], registry: SchemaRegistry) -> bool:
    """Whether the shadow decided what the log recorded: ``_normal`` of both as the log holds them (``as_logged``).
    Events equal in memory are equal on the log (the round trip is a function): only others are written and read."""
    if _normal(recorded) == _normal(decided):
        return True
    sides = []
    for events in (recorded, decided):
        logged = [as_logged(e, registry) for e in events]
        if any(e is None for e in logged):
            return False  # one side holds what no producer could write: no decision the log could hold
        sides.append(_normal(e for e in logged if e is not None))
    return sides[0] == sides[1]


def _normal(events: Iterable[Event]) -> list[tuple]:
    """A decision's events as compared: id, type and payload without ``commit_attempts``."""
    out = []
    for e in events:
        p = {k: v for k, v in e.payload.items() if k != "commit_attempts"}
        out.append((e.event_id, e.type, _frozen(p)))
    return sorted(out, key=lambda x: (x[1], x[0]))


def _frozen(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


def summary(events: Iterable[Event]) -> dict[str, Any]:
    """A decision in a few fields: where each task went, machines added and released, what was freed, rejected."""
    out: dict[str, Any] = {"placed": {}, "machines_added": [], "freed": {}, "machines_released": [], "rejected": {}}
    for e in events:
        p = e.payload
        if e.type == "TasksAllocated":
            out["placed"].update({r["task_id"]: r["machine_id"] for r in p["placements"]})
            out["machines_added"] += p.get("machines_added") or []
            if p.get("filter_rejections"):
                out["filter_rejections"] = dict(p["filter_rejections"])
        elif e.type == "TasksDeallocated":
            out["freed"].update({r["task_id"]: r["machine_id"] for r in p["placements"]})
            out["machines_released"] += p.get("machines_released") or []
        elif e.type == "AllocationRejected":
            out["rejected"].setdefault(p["reason"], []).extend(p["unplaced_task_ids"])
            if p.get("filter_rejections"):
                out["filter_rejections"] = dict(p["filter_rejections"])
    return {k: v for k, v in out.items() if v}


def compare(log: ShadowLog, region: Region, at_since: Mapping[str, str], until_ms: int,
            registry: SchemaRegistry) -> dict[str, Any]:
    """The diff of a shadow run (the module doc); ``registry``: the schemas both sides are compared under (``same``)."""
    since = log.since

    def in_window(events: list[Event]) -> bool:
        return bool(events) and since < min(e.timestamp_ms for e in events) <= until_ms

    recorded = {rid: evs for rid, evs in log.recorded.items() if in_window(evs)}
    decided = {rid: evs for rid, evs in log.decided.items() if in_window(evs) or rid in recorded}
    differ = []
    for rid in sorted(set(recorded) | set(decided), key=lambda r: min(e.timestamp_ms for e in (recorded.get(r) or decided[r]))):
        a, b = recorded.get(rid), decided.get(rid)
        if a is not None and b is not None and same(a, b, registry):
            continue
        req = log.requests.get(rid)
        evs = a or decided[rid]  # in one of them at least, and not empty there (``in_window``)
        first = evs[0]
        differ.append({"request": first.payload.get("request_id"), "job": first.payload.get("job_id"),
                       "time_ms": min(e.timestamp_ms for e in evs),
                       "recorded": None if a is None else summary(a), "shadow": None if b is None else summary(b),
                       **({"request_event_id": rid} if req is None else {})})
    rec_sched = {i: e for i, e in log.scheduler_recorded.items()
                 if e.type not in STATE_TYPES and since < e.timestamp_ms <= until_ms}
    mine_sched = {i: e for i, e in log.scheduler_decided.items()
                  if e.type not in STATE_TYPES and since < e.timestamp_ms <= until_ms}
    sched_differ = []
    for i in sorted(set(rec_sched) | set(mine_sched)):
        ra, rb = rec_sched.get(i), mine_sched.get(i)
        if ra is not None and rb is not None and ra.timestamp_ms == rb.timestamp_ms and same([ra], [rb], registry):
            continue
        e = ra if ra is not None else mine_sched[i]
        sched_differ.append({"event_id": i, "type": e.type, "entity": e.entity_id, "time_ms": e.timestamp_ms,
                             "in": "both" if ra is not None and rb is not None else ("log" if ra is not None else "shadow")})
    topology = {mid: m for mid, m in region.fold.machines.items()}
    rec_totals = totals(recorded.values(), at_since, topology)
    mine_totals = totals(decided.values(), at_since, topology)
    spread_differ = sorted(j for j in set(rec_totals["spread"]) | set(mine_totals["spread"])
                           if rec_totals["spread"].get(j) != mine_totals["spread"].get(j))
    totals_equal = {k: rec_totals[k] == mine_totals[k] for k in rec_totals}
    return {
        "decisions_compared": len(set(recorded) | set(decided)), "decisions_differ": len(differ),
        "decisions": differ[:SHOWN],
        "scheduler_events_compared": len(set(rec_sched) | set(mine_sched)), "scheduler_events_differ": len(sched_differ),
        "scheduler": sched_differ[:SHOWN],
        "totals": {"recorded": rec_totals, "shadow": mine_totals}, "totals_equal": totals_equal,
        "spread_differs": spread_differ,
        "synthesized_reports": log.synthesized, "dropped_reports": log.dropped_reports,
        "looped_jobs": dict(sorted(log.looped.items())),  # requests deferred: a job asking again at one instant
        "empty": not log.looped and not differ and not sched_differ and all(totals_equal.values()),
    }


def totals(decisions: Iterable[list[Event]], at_since: Mapping[str, str], machines: Mapping[str, Any]  # noqa: C901
           ) -> dict[str, Any]:
    """One side's totals over its decisions (applied in time order to the placements at ``since``)."""
    placed = dict(at_since)
    out: dict[str, Any] = {"requests": 0, "tasks_placed": 0, "moves": 0, "rejections": Counter(),
                           "tasks_rejected": Counter()}
    for events in sorted(decisions, key=lambda evs: (min(e.timestamp_ms for e in evs), evs[0].event_id)):
        out["requests"] += 1
        freed: dict[str, str] = {}
        for e in sorted(events, key=lambda e: e.type != "TasksDeallocated"):  # a request frees, then places
            p = e.payload
            if e.type == "TasksDeallocated":
                for r in p["placements"]:
                    if placed.get(r["task_id"]) == r["machine_id"]:
                        freed[r["task_id"]] = placed.pop(r["task_id"])
            elif e.type == "TasksAllocated":
                for r in p["placements"]:
                    before = placed.get(r["task_id"]) or freed.get(r["task_id"])
                    if before is not None and before != r["machine_id"]:
                        out["moves"] += 1
                    placed[r["task_id"]] = r["machine_id"]
                    out["tasks_placed"] += 1
            elif e.type == "AllocationRejected":
                out["rejections"][p["reason"]] += 1
                out["tasks_rejected"][p["reason"]] += len(p["unplaced_task_ids"])
    used: dict[str, set[str]] = defaultdict(set)
    spread: dict[str, Counter] = defaultdict(Counter)
    for task, mid in placed.items():
        job = task.rpartition("/")[0]
        used[job.partition(".")[0]].add(mid)
        m = machines.get(mid)
        spread[job][f"{m.dc}/{m.msb}" if m is not None else "?"] += 1
    out["rejections"] = dict(out["rejections"])
    out["tasks_rejected"] = dict(out["tasks_rejected"])
    out["machines_used"] = len(set().union(*used.values())) if used else 0
    out["machines_used_per_entitlement"] = {e: len(ms) for e, ms in sorted(used.items())}
    out["spread"] = {j: dict(sorted(c.items())) for j, c in sorted(spread.items())}
    return out
