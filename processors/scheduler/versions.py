"""Several spec versions in one job: the version mix the Job Control Plane reconciles, held by the scheduler. Pure.

A job normally runs one spec version, the job's: a rolling update moves every task to it (``decide.py``). A job
that the Job Control Plane (``processors/jobcontrol``) reconciled with a push or a canary holds a **mix** instead
(``JobSpecReconciled``), and runs up to three versions at once:

    stable   the version of the tasks that are neither push targets nor canaries
    push     the push's target version, on ``percent`` % of the NON-canary tasks (rounded half up)
    canary   the canary's version, on ``canary_count`` tasks

The versions differ in what they run (argv, env); resources, requirements, spread and the controller are the
job's, shared by every version (a resources change makes new version numbers for every version in use, so every
task rolls: ``processors/jobcontrol``). Which task runs which version is a pure function of the job's live tasks
(indices ``0 .. desired-1``: a shrink retires the highest indices, a grow adds the next ones), the mix and the
canary picks (``targets``):

* **Push order.** Live tasks are ranked by the bit-reversed binary of their index (the van der Corput sequence:
  0, 2, 1, 3 for four tasks; every even index before every odd one). The push targets are the first ``tB`` of
  the non-canary tasks in that order, ``tB = round_half_up(percent * non_canary / 100)``. Raising the percent only
  adds targets (a push step never moves a task back), and the order interleaves so that any prefix of indices,
  and any contiguous range of them, holds its share of targets: at 50 % a target is every other index. A shrink
  (which keeps a prefix) or a grow (which appends) changes the targets of at most a task or two, whatever the
  sizes: the push percentage holds through sizing.
* **Canary picks** (``pick_canaries``) are sticky: a canary task stays one while it is live. Missing picks (a
  new canary, or a shrink that retired one) are taken among the live tasks that are not push targets, last in
  push order first, so a canary never takes a push target's task (unless the push is at 100 %: then there is no
  other). Canary tasks never count toward the push: its ``tB`` is a share of the non-canary tasks.

The scheduler turns the targets into operations as for a rolling update: a task whose version is not its target
gets an UPDATE (approved by the job's TaskController, paced by ``max_unavailable`` and the rate limiter); an
unplaced task just takes its target; a new task starts with it. Retiring tasks (index ``>= desired``) keep
theirs.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

Pairs = tuple[tuple[str, str], ...]

ROLE_STABLE = "stable"
ROLE_PUSH = "push"
ROLE_CANARY = "canary"


@dataclass(frozen=True, slots=True)
class Code:
    """What one version runs."""

    version: int
    label: str
    command: tuple[str, ...]
    env: Pairs = ()


@dataclass(frozen=True, slots=True)
class Mix:
    """The version mix of a job (the scheduler's copy of a JobSpecReconciled)."""

    generation: int  # the reconciliation it came from (a later one replaces it; an older one is stale)
    submission: str  # the JobSubmitted event id of the incarnation it was reconciled for
    codes: tuple[Code, ...]  # every version a task of the job may run
    stable: int
    push: int | None = None
    percent: int = 0  # of the non-canary tasks on ``push``
    steps: tuple[int, ...] = ()  # the push's step plan (shown; the Job Control Plane checks it)
    canary: int | None = None
    canary_count: int = 0
    canary_tasks: tuple[int, ...] = ()  # indices picked as canaries (sorted), kept while live

    def code(self, version: int) -> Code | None:
        return next((c for c in self.codes if c.version == version), None)


def push_key(index: int) -> int:
    """A task's place in push order: its index's 32 bits reversed (van der Corput)."""
    return int(format(index, "032b")[::-1], 2)


def round_half_up(percent: int, n: int) -> int:
    """``percent`` % of ``n``, rounded half up: the push's target count."""
    return (percent * n * 2 + 100) // 200


def mix_of(p: Mapping[str, Any], previous: Mix | None = None) -> Mix:
    """The mix of a JobSpecReconciled payload; the canary picks of ``previous`` are kept while it is the same
    canary version."""
    codes = tuple(Code(v["version"], v.get("label", ""), tuple(v["command"]), tuple(sorted(v.get("env", {}).items())))
                  for v in p["versions"])
    push, canary = p.get("push"), p.get("canary")
    picks: tuple[int, ...] = ()
    if previous is not None and canary is not None and previous.canary == canary["version"]:
        picks = previous.canary_tasks
    return Mix(generation=p["generation"], submission=p.get("submission_id", ""), codes=codes,
               stable=p["stable_version"], push=push["version"] if push else None,
               percent=push["percent"] if push else 0, steps=tuple(push.get("steps", ())) if push else (),
               canary=canary["version"] if canary else None, canary_count=canary["count"] if canary else 0,
               canary_tasks=picks)


def _push_targets(live: Iterable[int], percent: int, exclude: frozenset[int] = frozenset(), *,
                  extra_excluded: int = 0) -> list[int]:
    """The push targets among ``live`` minus ``exclude``: the first ``tB`` in push order; ``tB`` counts
    ``extra_excluded`` more tasks out of the non-canary ones (canaries not picked yet)."""
    rest = sorted((i for i in live if i not in exclude), key=push_key)
    return rest[:round_half_up(percent, max(0, len(rest) - extra_excluded))]


def pick_canaries(mix: Mix, desired: int) -> Mix:
    """``mix`` with its canary picks for a job of ``desired`` live tasks: the live picks kept, the missing ones
    taken among the live non-push tasks, last in push order first (push targets only if nothing else is left)."""
    if mix.canary is None or mix.canary_count <= 0:
        return mix if not mix.canary_tasks else replace(mix, canary_tasks=())
    count = min(mix.canary_count, desired)
    kept = tuple(i for i in mix.canary_tasks if i < desired)[:count]
    need = count - len(kept)
    if need <= 0:
        return mix if kept == mix.canary_tasks else replace(mix, canary_tasks=kept)
    taken = frozenset(kept)
    pushed = set(_push_targets(range(desired), mix.percent if mix.push is not None else 0, taken,
                               extra_excluded=need))
    order = sorted((i for i in range(desired) if i not in taken), key=push_key, reverse=True)
    picks = [i for i in order if i not in pushed][:need]
    if len(picks) < need:  # a push at 100 %: the canary has to take push targets
        picks += [i for i in order if i in pushed][:need - len(picks)]
    return replace(mix, canary_tasks=tuple(sorted((*kept, *picks))))


def targets(mix: Mix, desired: int) -> dict[int, int]:
    """The version each live task (index ``0 .. desired-1``) is to run. ``mix`` must carry its picks for
    ``desired`` (``pick_canaries``)."""
    canary = mix.canary
    canaries = frozenset(i for i in mix.canary_tasks if i < desired) if canary is not None else frozenset()
    out = dict.fromkeys(range(desired), mix.stable)
    if mix.push is not None:
        for i in _push_targets(range(desired), mix.percent, canaries):
            out[i] = mix.push
    if canary is not None:
        out.update(dict.fromkeys(canaries, canary))
    return out


def role(mix: Mix, version: int) -> str:
    """What running ``version`` makes a task in ``mix``: canary, push target or stable."""
    if mix.canary is not None and version == mix.canary:
        return ROLE_CANARY
    if mix.push is not None and version == mix.push:
        return ROLE_PUSH
    return ROLE_STABLE


def shares(mix: Mix, versions: Mapping[int, int], desired: int) -> dict[str, int]:
    """Count live tasks (index -> version running or to start with) by role: what ``job status`` shows and the
    combined test checks."""
    out = {ROLE_STABLE: 0, ROLE_PUSH: 0, ROLE_CANARY: 0}
    for i, v in versions.items():
        if i < desired:
            out[role(mix, v)] += 1
    return out


# -- records (faust table values) --------------------------------------------------------------------------------

def mix_record(m: Mix | None) -> dict | None:
    if m is None:
        return None
    return {"generation": m.generation, "submission": m.submission,
            "codes": [[c.version, c.label, list(c.command), [list(e) for e in c.env]] for c in m.codes],
            "stable": m.stable, "push": m.push, "percent": m.percent, "steps": list(m.steps), "canary": m.canary,
            "canary_count": m.canary_count, "canary_tasks": list(m.canary_tasks)}


def mix_from_record(r: Mapping[str, Any] | None) -> Mix | None:
    if r is None:
        return None
    return Mix(generation=r["generation"], submission=r["submission"],
               codes=tuple(Code(v, label, tuple(cmd), tuple(map(tuple, env))) for v, label, cmd, env in r["codes"]),
               stable=r["stable"], push=r["push"], percent=r["percent"], steps=tuple(r["steps"]), canary=r["canary"],
               canary_count=r["canary_count"], canary_tasks=tuple(r["canary_tasks"]))


def mix_view(m: Mix | None) -> dict | None:
    """The mix as ``job status --json`` shows it."""
    if m is None:
        return None
    return {"generation": m.generation, "stable_version": m.stable,
            "push": None if m.push is None else {"version": m.push, "percent": m.percent, "steps": list(m.steps)},
            "canary": None if m.canary is None else {"version": m.canary, "count": m.canary_count,
                                                      "tasks": list(m.canary_tasks)},
            "versions": [{"version": c.version, "label": c.label} for c in m.codes]}
