"""Host profiles on the agent's side (Sidekick, Twine §2.6). Pure: no files, no Kafka, no clock.

A machine's agent keeps a ``HostState``: the profile applied (``""`` is the default profile), the switch under way
(a ``HostProfileRequested`` being applied by the wiring), the latest request that came meanwhile, the profile
whose switch failed, and the START/RESTART commands held because the profile their command requires is not
applied. The wiring carries out ``Apply`` (the process agent writes the profile's settings to a file under its
machine directory; simulated agents wait the profile's switch time) and reports back with ``done``.

```
 HostProfileRequested(machine, profile) ─► request() ─► profile applied already, nothing under way:
                                                          HostProfileApplied at once (nothing to do)
                                                        a switch under way: kept, started after it (latest wins)
                                                        else: Apply(profile, settings) ─► the wiring
 the wiring's result ─────────────────► done(ok) ──► HostProfileApplied; the held commands that need it run
                                         done(failed) ► HostProfileFailed; the held commands that need it are
                                                        answered FAILED (host_profile_failed): the scheduler moves
                                                        the task elsewhere
 TaskCommanded START/RESTART ─────────► gate() ────► RUN: no profile named (older producers), or the one named is
                                                          applied and no switch is under way
                                                     HOLD: kept until that profile is applied
                                                     FAIL: the switch to it failed: FAILED at once
 TaskCommanded STOP ──────────────────► gate() ────► RUN (drops a held START of the task: decide answers the STOP)
```

**The rule it enforces: no task starts on a machine whose applied profile differs from the one its command
names** (the scheduler names its entitlement's profile in every TasksCommanded). Held commands are not reported:
the scheduler sees the task STARTING until it runs (or fails here).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from processors.agent import decide as d
from streams.enums import TaskCommand
from streams.events import Event, derived_event_id, new_event

REASON_HOST_PROFILE_FAILED = "host_profile_failed"  # TaskStateChanged.reason: not started, the profile failed
REASON_WAITING_FOR_PROFILE = "waiting_for_host_profile"  # STARTING: held until the machine has the job's profile
DEFAULT_PROFILE = ""
REQUEST_TYPE = "HostProfileRequested"  # what an agent reads of ``tasks`` beside the commands

RUN, HOLD, FAIL = "run", "hold", "fail"  # gate() verdicts


@dataclass(frozen=True)
class Switch:
    request_id: str
    host_profile: str
    entitlement: str  # the request's key: the answer is keyed the same
    settings: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class HostState:
    machine_id: str
    applied: str = DEFAULT_PROFILE
    switching: Switch | None = None
    queued: Switch | None = None
    failed: str | None = None  # the profile whose latest switch failed
    held: tuple[Event, ...] = ()  # TaskCommanded START/RESTART waiting for their profile

    @property
    def idle(self) -> bool:
        """Nothing to remember beyond the default profile (the simulated agents keep only the others)."""
        return (self.applied == DEFAULT_PROFILE and self.switching is None and self.queued is None
                and self.failed is None and not self.held)


@dataclass(frozen=True)
class Apply:
    """For the wiring: apply ``host_profile`` (its ``settings``) on the machine, then call ``done``."""

    machine_id: str
    request_id: str
    host_profile: str
    settings: Mapping[str, str]


def _switch_of(ev: Event) -> Switch:
    p = ev.payload
    return Switch(p["request_id"], p["host_profile"] or DEFAULT_PROFILE, ev.entitlement,
                  tuple(sorted((p.get("settings") or {}).items())))


def _answer(h: HostState, sw: Switch, now_ms: int, previous: str, error: str | None = None) -> Event:
    producer = f"{d.PRODUCER}/{h.machine_id}"
    if error is None:
        return new_event("HostProfileApplied", {"machine_id": h.machine_id, "host_profile": sw.host_profile,
                                                "previous_host_profile": previous, "request_id": sw.request_id},
                         entitlement=sw.entitlement, entity_id=h.machine_id, producer=producer, timestamp_ms=now_ms,
                         event_id=derived_event_id(d.PRODUCER, h.machine_id, sw.request_id, "applied"))
    return new_event("HostProfileFailed", {"machine_id": h.machine_id, "host_profile": sw.host_profile,
                                           "request_id": sw.request_id, "reason": error},
                     entitlement=sw.entitlement, entity_id=h.machine_id, producer=producer, timestamp_ms=now_ms,
                     event_id=derived_event_id(d.PRODUCER, h.machine_id, sw.request_id, "failed"))


def request(h: HostState, ev: Event, now_ms: int) -> tuple[HostState, list[Event], list[Apply]]:
    """A HostProfileRequested: start the switch, keep it for after the one under way, or answer at once."""
    if ev.payload["machine_id"] != h.machine_id:
        return h, [], []
    sw = _switch_of(ev)
    if (h.switching is not None and h.switching.request_id == sw.request_id) or \
            (h.queued is not None and h.queued.request_id == sw.request_id):
        return h, [], []  # a redelivery
    if h.switching is not None:
        return replace(h, queued=sw), [], []
    if sw.host_profile == h.applied:
        return replace(h, failed=None), [_answer(h, sw, now_ms, h.applied)], []
    return replace(h, switching=sw), [], [Apply(h.machine_id, sw.request_id, sw.host_profile, dict(sw.settings))]


def done(h: HostState, request_id: str, now_ms: int, error: str | None = None
         ) -> tuple[HostState, list[Event], list[Apply], list[Event]]:
    """The wiring applied the switch (``error`` None) or could not. Returns the new state, the events (the answer,
    FAILED reports of held commands that needed a failed profile), the next Apply (a queued request) and the held
    commands that may run now (to be fed to ``decide``)."""
    sw = h.switching
    if sw is None or sw.request_id != request_id:
        return h, [], [], []  # not the switch under way (a late or repeated result)
    previous = h.applied
    events = [_answer(h, sw, now_ms, previous, error)]
    h = replace(h, switching=None)
    if error is None:
        h = replace(h, applied=sw.host_profile, failed=None)
    else:
        h = replace(h, failed=sw.host_profile)
    run, keep = [], []
    for cmd in h.held:
        verdict = _verdict(h, cmd)
        if verdict == RUN:
            run.append(cmd)
        elif verdict == FAIL:
            events.append(d.refused_start(h.machine_id, cmd, REASON_HOST_PROFILE_FAILED, now_ms))
        else:
            keep.append(cmd)
    h = replace(h, held=tuple(keep))
    actions: list[Apply] = []
    if h.queued is not None:
        queued, h = h.queued, replace(h, queued=None)
        h, more, actions = _start_queued(h, queued, now_ms)
        events += more
        if not actions:  # answered at once: held commands may run after all
            run += [c for c in h.held if _verdict(h, c) == RUN]
            h = replace(h, held=tuple(c for c in h.held if _verdict(h, c) != RUN))
    return h, events, actions, run


def _start_queued(h: HostState, sw: Switch, now_ms: int) -> tuple[HostState, list[Event], list[Apply]]:
    if sw.host_profile == h.applied:
        return replace(h, failed=None), [_answer(h, sw, now_ms, h.applied)], []
    return replace(h, switching=sw), [], [Apply(h.machine_id, sw.request_id, sw.host_profile, dict(sw.settings))]


def _verdict(h: HostState, cmd: Event) -> str:
    needed = cmd.payload.get("host_profile")
    if needed is None:
        return RUN  # an older producer: not checked
    if h.switching is None and needed == h.applied:
        return RUN
    if needed == h.failed and h.switching is None and (h.queued is None or h.queued.host_profile != needed):
        return FAIL
    return HOLD


def gate(h: HostState, cmd: Event, now_ms: int) -> tuple[HostState, str, list[Event]]:
    """A TaskCommanded for this machine: RUN (feed it to ``decide``), HOLD (kept here) or FAIL (answered with the
    FAILED report returned)."""
    p = cmd.payload
    if p["command"] == TaskCommand.STOP:
        held = tuple(c for c in h.held if c.payload["task_id"] != p["task_id"])
        return (replace(h, held=held) if len(held) != len(h.held) else h), RUN, []
    verdict = _verdict(h, cmd)
    if verdict == RUN:
        return h, RUN, []
    if verdict == FAIL:
        return h, FAIL, [d.refused_start(h.machine_id, cmd, REASON_HOST_PROFILE_FAILED, now_ms)]
    held = tuple(c for c in h.held if c.payload["task_id"] != p["task_id"]) + (cmd,)  # the latest per task
    # said, so `job status` tells why the task is not running yet (it said "submitted" while it waited)
    return replace(h, held=held), HOLD, [d.held_start(h.machine_id, cmd, REASON_WAITING_FOR_PROFILE, now_ms)]


# -- persistence (the agents' state files) --------------------------------------------------------------------

def to_json(h: HostState) -> dict:
    def sw(s: Switch | None):
        return None if s is None else [s.request_id, s.host_profile, s.entitlement, [list(kv) for kv in s.settings]]
    return {"applied": h.applied, "switching": sw(h.switching), "queued": sw(h.queued), "failed": h.failed,
            "held": [c.to_record() for c in h.held]}


def from_json(machine_id: str, doc: Mapping) -> HostState:
    def sw(s):
        return None if s is None else Switch(s[0], s[1], s[2], tuple(tuple(kv) for kv in s[3]))
    return HostState(machine_id, applied=doc.get("applied", DEFAULT_PROFILE), switching=sw(doc.get("switching")),
                     queued=sw(doc.get("queued")), failed=doc.get("failed"),
                     held=tuple(Event.from_record("TaskCommanded", r) for r in doc.get("held", ())))
