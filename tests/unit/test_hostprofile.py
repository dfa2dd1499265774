"""Host profiles: the agent's gate (processors/agent/hostprofile.py) and Sidekick's decisions
(processors/sidekick/decide.py). Pure: no broker."""
import pytest

from allocator_log import Log, allocated, ev as alloc_ev, reg, requested, status
from processors.agent import hostprofile as hp
from processors.sidekick import decide as sk
from processors.sidekick import catalogue
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000
M = "m1"


def request_ev(profile, rid="r1", machine=M, ent="e1"):
    return new_event("HostProfileRequested", {"request_id": rid, "machine_id": machine, "host_profile": profile,
                                              "previous_host_profile": None,
                                              "settings": dict(catalogue.PROFILES[profile].settings)},
                     entitlement=ent, entity_id=machine, producer="sidekick", timestamp_ms=T0, event_id=f"ev-{rid}")


def command(task, cmd="START", profile="web", machine=M):
    return new_event("TaskCommanded", {"task_id": task, "job_id": task.rsplit("/", 1)[0], "machine_id": machine,
                                       "command": cmd, "argv": ["sleep", "1"], "env": {}, "spec_version": 1,
                                       "reason": "placed", "host_profile": profile},
                     entitlement="e1", entity_id=task, producer="scheduler", timestamp_ms=T0, event_id=f"c-{task}-{cmd}")


def encode(events):
    for e in events:
        REG.encode(e.type, e.to_record(schema_version=1))
    return events


# -- the agent's gate -----------------------------------------------------------------------------------------

GATE = {
    # name: (host state, command, verdict)
    "default-wanted-default-applied": (hp.HostState(M), command("j/0", profile=""), hp.RUN),
    "not-checked-without-a-profile": (hp.HostState(M), command("j/0", profile=None), hp.RUN),
    "profile-applied": (hp.HostState(M, applied="web"), command("j/0"), hp.RUN),
    "profile-missing": (hp.HostState(M), command("j/0"), hp.HOLD),
    "switch-under-way": (hp.HostState(M, applied="web", switching=hp.Switch("r2", "turbo", "e1")), command("j/0"),
                         hp.HOLD),
    "switch-to-it-failed": (hp.HostState(M, failed="web"), command("j/0"), hp.FAIL),
    "a-stop-passes": (hp.HostState(M), command("j/0", cmd="STOP"), hp.RUN),
}


@pytest.mark.parametrize("host, cmd, verdict", GATE.values(), ids=GATE)
def test_gate(host, cmd, verdict):
    h, got, events = hp.gate(host, cmd, T0)
    assert got == verdict
    assert (cmd in h.held) == (verdict == hp.HOLD)
    if verdict == hp.FAIL:
        (report,) = encode(events)
        assert (report.payload["state"], report.payload["reason"]) == ("FAILED", hp.REASON_HOST_PROFILE_FAILED)
    elif verdict == hp.HOLD:  # said: the task waits for its profile (`job status` showed "submitted", issue 30)
        (report,) = encode(events)
        assert (report.payload["state"], report.payload["reason"]) == ("STARTING", hp.REASON_WAITING_FOR_PROFILE)
        assert report.event_id != hp.d.refused_start(M, cmd, "x", T0).event_id
    else:
        assert events == []


def test_a_start_waits_for_its_profile_then_runs():
    h = hp.HostState(M)
    h, verdict, _ = hp.gate(h, command("j/0"), T0)
    assert verdict == hp.HOLD
    h, events, actions, run = hp.done(h, "nothing-under-way", T0)
    assert (events, actions, run) == ([], [], [])  # a result for no switch changes nothing
    h, events, actions = hp.request(h, request_ev("web"), T0)
    assert events == [] and [a.host_profile for a in actions] == ["web"]
    assert dict(actions[0].settings) == dict(catalogue.PROFILES["web"].settings)
    assert hp.request(h, request_ev("web"), T0 + 1) == (h, [], [])  # redelivered: nothing new
    h, events, actions, run = hp.done(h, "r1", T0 + 3000)
    (applied,) = encode(events)
    assert applied.type == "HostProfileApplied" and applied.payload["request_id"] == "r1"
    assert (h.applied, h.switching, h.held, [c.payload["task_id"] for c in run]) == ("web", None, (), ["j/0"])


def test_a_failed_switch_fails_the_held_starts_and_the_next_request_may_succeed():
    h = hp.HostState(M)
    h, _, _ = hp.gate(h, command("j/0"), T0)
    h, _, _ = hp.request(h, request_ev("web"), T0)
    h, events, _, run = hp.done(h, "r1", T0, error="no huge pages")
    assert [e.type for e in encode(events)] == ["HostProfileFailed", "TaskStateChanged"]
    assert run == [] and h.held == () and h.failed == "web" and h.applied == ""
    h, _, actions = hp.request(h, request_ev("web", rid="r2"), T0)
    h, events, _, _ = hp.done(h, "r2", T0)
    assert h.applied == "web" and h.failed is None


def test_a_request_during_a_switch_follows_it_the_latest_wins():
    h = hp.HostState(M)
    h, _, _ = hp.request(h, request_ev("web", rid="r1"), T0)
    h, _, _ = hp.request(h, request_ev("turbo", rid="r2"), T0)
    h, _, _ = hp.request(h, request_ev("hugepages", rid="r3"), T0)
    h, events, actions, _ = hp.done(h, "r1", T0)
    assert [a.request_id for a in actions] == ["r3"] and h.switching.host_profile == "hugepages"


def test_a_request_for_the_profile_applied_is_answered_at_once():
    h, events, actions = hp.request(hp.HostState(M, applied="web"), request_ev("web"), T0)
    assert actions == [] and [e.type for e in encode(events)] == ["HostProfileApplied"]


def test_the_state_survives_a_restart():
    h = hp.HostState(M)
    h, _, _ = hp.gate(h, command("j/0"), T0)
    h, _, _ = hp.request(h, request_ev("web"), T0)
    assert hp.from_json(M, hp.to_json(h)) == h


# -- Sidekick -------------------------------------------------------------------------------------------------

def created(name, quota, profile):
    return alloc_ev("EntitlementCreated", name, name, {"name": name, "quota_machines": quota, "machine_type": None,
                                                        "dc_pin": None, "host_profile": profile})


def sidekick(*events):
    view, log = sk.SidekickView(), Log()
    for e in events:
        view.apply(*log.add(e))
    return view, log


def machines(n):
    return [reg(f"m{i:02d}") for i in range(n)]


def holding(n, profile="web"):
    ids = [f"m{i:02d}" for i in range(n)]
    return [created("e1", 100, profile), *machines(n), requested("r0", "e1", [f"j/{i}" for i in range(n)]),
            allocated("r0", "e1", [(f"j/{i}", mid) for i, mid in enumerate(ids)], added=ids)]


def answered(event, failed=False):
    p = event.payload
    if failed:
        return alloc_ev("HostProfileFailed", event.entitlement, p["machine_id"], {
            "machine_id": p["machine_id"], "host_profile": p["host_profile"], "request_id": p["request_id"],
            "reason": "test"})
    return alloc_ev("HostProfileApplied", event.entitlement, p["machine_id"], {
        "machine_id": p["machine_id"], "host_profile": p["host_profile"], "previous_host_profile": None,
        "request_id": p["request_id"]})


def test_at_most_a_fraction_of_an_entitlements_machines_switch_at_once():
    view, log = sidekick(*holding(20))
    first = encode(view.switches(T0, max_switching=0.1))
    assert [e.payload["machine_id"] for e in first] == ["m00", "m01"]  # 10 % of 20
    assert view.switches(T0, 0.1) == []  # both in flight: nothing more
    view.apply(*log.add(answered(first[0])))
    nxt = view.switches(T0, 0.1)
    assert [e.payload["machine_id"] for e in nxt] == ["m02"]
    assert {e.payload["host_profile"] for e in first + nxt} == {"web"}


def test_a_small_entitlement_still_switches_one_machine():
    view, _ = sidekick(*holding(3))
    assert len(view.switches(T0, 0.1)) == 1


def test_a_failed_switch_is_not_asked_again_and_a_lost_one_is():
    view, log = sidekick(*holding(2))
    a, b = view.switches(T0, 1.0)
    view.apply(*log.add(answered(a, failed=True)))
    assert view.switches(T0, 1.0) == []  # a failed (not again), b in flight
    later = view.switches(T0 + sk.SWITCH_TIMEOUT_MS, 1.0)
    assert [e.payload["machine_id"] for e in later] == [b.payload["machine_id"]]


def test_machines_with_the_profile_free_or_down_are_left_alone():
    view, log = sidekick(*holding(3, profile=None), status("m02", "DOWN", ent="e1"), reg("m09"))
    assert view.switches(T0, 1.0) == []  # the default wanted and applied; m09 free
    view, log = sidekick(*holding(3), status("m02", "DOWN", ent="e1"))
    assert sorted(e.payload["machine_id"] for e in view.switches(T0, 1.0)) == ["m00", "m01"]


def test_the_same_log_asks_the_same_requests():
    a, _ = sidekick(*holding(5))
    b, _ = sidekick(*holding(5))
    assert a.switches(T0, 0.5) == b.switches(T0, 0.5)


def test_requests_from_the_log_count_as_in_flight_after_a_restart():
    view, log = sidekick(*holding(4))
    asked = view.switches(T0, 0.5)
    again, _ = sidekick(*holding(4), *asked)
    assert again.switches(T0, 0.5) == []
