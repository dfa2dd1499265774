"""The reference TaskControllers and the controller library's bookkeeping, as tables over in-memory data."""
import pytest

from processors.taskcontrol import protocol as tc
from processors.taskcontrol.controller import Books, absorb, answer, due, producer_name
from processors.taskcontrol.controllers import LeaderLast, Pacing, ReplicaAware
from processors.taskcontrol.protocol import Operation, Request, View
from streams.events import new_event
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()


def upd(task):
    return Operation(f"{task}:update", task, tc.OP_UPDATE, "rolling_update")


def req(tasks, seq=1, unhealthy=(), completed=(), job="zk"):
    return Request(job, "e1", "c", seq, tuple(upd(t) for t in tasks), tuple(completed), (), tuple(unhealthy), f"r{seq}")


def view(*in_flight, job="zk"):
    return View(job, {f"{t}:update": upd(t) for t in in_flight})


def tasks_of(answer):
    return [i.split(":")[0] for i in tc.answer_of(answer).approved]


LEADER_LAST = {  # request, view → approved tasks (leader: t0)
    "followers-first-one-at-a-time": (req(["t0", "t1", "t2"]), view(), ["t1"]),
    "nothing-while-one-is-in-flight": (req(["t0", "t2"]), view("t1"), []),
    "nothing-while-a-follower-is-down": (req(["t0", "t2"], unhealthy=["t1"]), view(), []),
    "a-down-follower-is-approved": (req(["t0", "t1", "t2"], unhealthy=["t2"]), view(), ["t2"]),
    "the-leader-alone-and-all-serving": (req(["t0"]), view(), ["t0"]),
    "the-leader-waits-for-the-last-follower": (req(["t0"]), view("t2"), []),
    "the-leader-waits-for-a-sick-follower": (req(["t0"], unhealthy=["t1"]), view(), []),
    "no-leader-known": (req(["t0", "t1"], job="other"), view(job="other"), ["t0"]),
}


@pytest.mark.parametrize("request_, view_, approved", LEADER_LAST.values(), ids=LEADER_LAST)
def test_leader_last(request_, view_, approved):
    assert tasks_of(LeaderLast({"zk": "t0"})(request_, view_)) == approved


def test_leader_last_changes_the_leader_once_per_release():
    """Replay a whole release: the controller alone decides the order; the leader is always the last."""
    n, order = 5, []
    decide = LeaderLast({"zk": "t0"})
    pending, flight, seq = [f"t{i}" for i in range(n)], [], 0
    while pending:
        seq += 1
        ok = tasks_of(decide(req(pending, seq), view(*flight)))
        assert len(ok) <= 1
        for t in ok:
            pending.remove(t)
            order.append(t)
        flight = []  # each approved update completes before the next request
    assert order[-1] == "t0" and sorted(order) == sorted(f"t{i}" for i in range(n))


SHARDS = {"t0": ["a", "b"], "t1": ["a", "c"], "t2": ["b", "c"], "t3": ["a", "b"], "t4": ["c"]}  # a:3 b:3 c:3
REPLICA_AWARE = {  # request, view, min_live → approved
    "two-live-of-three-allows-disjoint": (req(["t0", "t1", "t2", "t3", "t4"]), view(), 2, ["t0", "t4"]),
    "shard-c-has-room-after-t0": (req(["t1", "t4"]), view("t0"), 2, ["t4"]),
    "a-task-down-for-another-reason-counts": (req(["t0", "t1"], unhealthy=["t3"]), view(), 2, []),
    "a-down-task-is-approved": (req(["t3"], unhealthy=["t3"]), view(), 2, ["t3"]),
    "one-live-is-enough": (req(["t0", "t1", "t2", "t3"]), view(), 1, ["t0", "t1", "t2"]),
}


@pytest.mark.parametrize("request_, view_, min_live, approved", REPLICA_AWARE.values(), ids=REPLICA_AWARE)
def test_replica_aware(request_, view_, min_live, approved):
    got = tasks_of(ReplicaAware(SHARDS, min_live)(request_, view_))
    assert got == approved
    down = set(request_.unhealthy) | set(view_.in_flight_tasks) | set(got)
    for shard in {s for hosted in SHARDS.values() for s in hosted}:
        live = sum(shard in hosted for t, hosted in SHARDS.items() if t not in down)
        before = sum(shard in hosted for t, hosted in SHARDS.items()
                     if t not in set(request_.unhealthy) | set(view_.in_flight_tasks))
        assert live >= min(min_live, before)


PACING = {  # load, in flight → approved count of 6 pending
    "off-peak-fast": (0.2, 0, 4),
    "normal": (0.6, 0, 2),
    "peak-slow": (0.9, 0, 1),
    "in-flight-count": (0.2, 3, 1),
    "full": (0.9, 1, 0),
}


@pytest.mark.parametrize("load, flying, count", PACING.values(), ids=PACING)
def test_pacing(load, flying, count):
    got = Pacing(lambda: load)(req([f"t{i}" for i in range(6)]), view(*[f"x{i}" for i in range(flying)]))
    assert len(tasks_of(got)) == count


# -- the library's bookkeeping --------------------------------------------------------------------------------

def request_event(seq, pending, completed=(), controller="zk-ctl", in_flight=None, ops=None):
    r = Request("zk", "e1", controller, seq, ops if ops is not None else tuple(upd(t) for t in pending),
                tuple(f"{t}:update" for t in completed), in_flight=in_flight)
    return new_event("TaskControlRequested", tc.request_payload(r), entitlement="e1", entity_id="zk",
                     producer="scheduler", event_id=f"req-{controller}-{seq}", timestamp_ms=1)


def approve_all(request, view_):
    return [o.operation_id for o in request.pending] + ["not-pending"]


def test_library_answers_the_latest_once_and_tracks_in_flight():
    b = Books()
    for e in (request_event(1, ["t0", "t1"]), request_event(2, ["t0", "t1"]),
              request_event(1, ["t9"], controller="another")):
        b = absorb(b, e, "zk-ctl")
    assert [r.sequence for r in due(b)] == [2], "superseded and other controllers' requests are not answered"
    b, ack = answer(b, due(b)[0], approve_all, "zk-ctl", 5)
    REG.encode(ack.type, ack.to_record(1))
    assert ack.payload == {"job_id": "zk", "sequence": 2, "approved_operation_ids": ["t0:update", "t1:update"],
                           "controller": "zk-ctl"} and ack.producer == producer_name("zk-ctl")
    assert due(b) == [] and set(b.jobs["zk"].in_flight) == {"t0:update", "t1:update"}
    b = absorb(b, ack, "zk-ctl")  # read back from the log: nothing changes
    assert due(b) == [] and set(b.jobs["zk"].in_flight) == {"t0:update", "t1:update"}
    b = absorb(b, request_event(3, [], completed=["t1"]), "zk-ctl")
    assert set(b.jobs["zk"].in_flight) == {"t0:update"} and [r.sequence for r in due(b)] == [3]


def test_library_rebuilt_from_the_log_does_not_answer_again():
    b = Books()
    r1 = request_event(1, ["t0"])
    b = absorb(b, r1, "zk-ctl")
    b, ack = answer(b, due(b)[0], approve_all, "zk-ctl", 5)
    replayed = Books()
    for e in (r1, ack):
        replayed = absorb(replayed, e, "zk-ctl")
    assert due(replayed) == [] and replayed.jobs == b.jobs


def test_an_ack_gone_stale_under_a_re_ask_is_not_in_flight_live_or_replayed():
    """The scheduler re-asks (request 2, same pending op) before ack 1 lands, so it ignores ack 1 as stale: the
    op is pending again, not in flight. A live controller must then approve it again, as a replay would (a
    leader-last controller that still counted it in flight would approve nothing, and the release stalled)."""
    leader_last = LeaderLast({"zk": "t0"}, 1)
    r1, r2 = request_event(1, ["t0"]), request_event(2, ["t0"])
    live = absorb(Books(), r1, "zk-ctl")
    live, ack1 = answer(live, due(live)[0], leader_last, "zk-ctl", 5)
    assert ack1.payload["approved_operation_ids"] == ["t0:update"]
    for e in (r2, ack1):  # live order: the re-ask is read, then the stale ack comes back
        live = absorb(live, e, "zk-ctl")
    replayed = Books()
    for e in (r1, r2, ack1):  # log order
        replayed = absorb(replayed, e, "zk-ctl")
    _, live_ack2 = answer(live, due(live)[0], leader_last, "zk-ctl", 6)
    _, replay_ack2 = answer(replayed, due(replayed)[0], leader_last, "zk-ctl", 6)
    assert live_ack2.payload["approved_operation_ids"] == replay_ack2.payload["approved_operation_ids"] == ["t0:update"]


def test_an_approval_whose_operation_was_replaced_leaves_the_in_flight_set():
    """Found by ``figure14 --pipeline`` (the release stalled with every task serving): ack 1 approves t1's MOVE #5,
    but the scheduler had re-asked, so it is stale; t1's operation is then replaced by MOVE #6. #5 is never
    pending or completed again, so by completions alone it stayed in flight for ever and a replica-aware
    controller counted t1 down for the rest of the release. A request now says what the scheduler holds in
    flight, and that is the in-flight set."""
    move = lambda n: Operation(f"t1:move:{n}", "t1", tc.OP_MOVE, "machine_failed")  # noqa: E731
    live = absorb(Books(), request_event(1, [], ops=(move(5),), in_flight=()), "zk-ctl")
    live, ack1 = answer(live, due(live)[0], approve_all, "zk-ctl", 5)  # stale: request 2 was sent already
    assert set(live.jobs["zk"].in_flight) == {"t1:move:5"}
    for e in (request_event(2, [], ops=(move(6),), in_flight=()), ack1,
              request_event(3, ["t2"], in_flight=("t1:move:6",)), request_event(4, ["t2"], in_flight=())):
        live = absorb(live, e, "zk-ctl")
        if e.type == "TaskControlRequested" and e.payload["sequence"] == 3:
            assert set(live.jobs["zk"].in_flight) == {"t1:move:6"}, "what the scheduler took is in flight"
            assert live.jobs["zk"].in_flight["t1:move:6"].task_id == "t1"
    assert live.jobs["zk"].in_flight == {}
    shards = {"t1": ["s"], "t2": ["s"], "t3": ["s"]}
    assert tasks_of(ReplicaAware(shards, 2)(due(live)[0], View("zk", live.jobs["zk"].in_flight))) == ["t2"]


def test_requests_without_the_in_flight_field_keep_the_completion_rule():
    b = absorb(Books(), request_event(1, ["t0", "t1"]), "zk-ctl")
    b, _ = answer(b, due(b)[0], approve_all, "zk-ctl", 5)
    b = absorb(b, request_event(2, [], completed=["t0"]), "zk-ctl")  # in_flight None: an older scheduler's request
    assert set(b.jobs["zk"].in_flight) == {"t1:update"}


def test_library_sends_the_answers_choices_for_noticed_tasks_only():
    r = Request("zk", "e1", "zk-ctl", 1, notices=(tc.AdvanceNotice("ue", ("t0",), 10, 5, 60_000),), event_id="r1")
    b = absorb(Books(), new_event("TaskControlRequested", tc.request_payload(r), entitlement="e1", entity_id="zk",
                                  producer="scheduler", event_id="r1", timestamp_ms=1), "zk-ctl")
    (due_r,) = due(b)
    assert due_r.notices == r.notices, "the notice, expected duration included, survives the payload"

    def choose(request, view_):
        return tc.Answer((), (tc.Choice("ue", "t0", tc.CHOICE_KEEP), tc.Choice("ue", "t9", tc.CHOICE_MOVE)))

    b, ack = answer(b, due_r, choose, "zk-ctl", 5)
    REG.encode(ack.type, ack.to_record(1))
    assert tc.choices_of(ack.payload) == (tc.Choice("ue", "t0", tc.CHOICE_KEEP),), "t9 is under no notice"
    assert due(b) == []


# -- maintenance choices ------------------------------------------------------------------------------------------

SHORT, LONG = 5 * 60_000, 2 * 3_600_000  # expected durations (the default keep threshold is 10 min)


def notice_req(noticed, duration=LONG, pending=(), unhealthy=(), job="zk", seq=1):
    """A request whose advance notice (ue) names ``noticed``; ``pending`` are update operations."""
    return Request(job, "e1", "c", seq, tuple(upd(t) for t in pending), (),
                   (tc.AdvanceNotice("ue", tuple(noticed), 10_000, 5_000, duration),), tuple(unhealthy), f"r{seq}")


def chosen(answer):
    return [(c.task_id, c.choice) for c in tc.answer_of(answer).choices]


M, K = tc.CHOICE_MOVE, tc.CHOICE_KEEP
LEADER_LAST_MAINTENANCE = {  # request, view → choices (leader t0, max_down 1)
    "one-follower-at-a-time": (notice_req(["t0", "t1", "t2"]), view(), [("t1", M)]),
    "short-or-long-it-moves": (notice_req(["t1", "t2"], SHORT), view(), [("t1", M)]),
    "nothing-while-a-task-is-down": (notice_req(["t0", "t2"], unhealthy=["t1"]), view(), []),
    "nothing-while-an-update-is-in-flight": (notice_req(["t2"]), view("t3"), []),
    "a-down-follower-moves-at-once": (notice_req(["t1", "t2"], unhealthy=["t2"]), view(), [("t2", M)]),
    "the-leader-last-and-alone": (notice_req(["t0"]), view(), [("t0", M)]),
    "the-leader-waits-for-a-follower-back": (notice_req(["t0"], unhealthy=["t1"]), view(), []),
    "the-leader-waits-for-follower-updates": (notice_req(["t0"], pending=["t1"]), view(), []),
    "an-approved-update-uses-the-room": (notice_req(["t1", "t2"], pending=["t3"]), view(), []),
}


@pytest.mark.parametrize("request_, view_, choices", LEADER_LAST_MAINTENANCE.values(), ids=LEADER_LAST_MAINTENANCE)
def test_leader_last_maintenance_choices(request_, view_, choices):
    assert chosen(LeaderLast({"zk": "t0"})(request_, view_)) == choices


def test_leader_last_moves_an_ensemble_off_one_at_a_time_leader_last():
    """A whole maintenance of a 5-member ensemble: each request after the previous move ran elsewhere."""
    decide, left, order, seq = LeaderLast({"zk": "t0"}), [f"t{i}" for i in range(5)], [], 0
    while left:
        seq += 1
        got = chosen(decide(notice_req(left, seq=seq), view()))
        assert len(got) == 1 and got[0][1] == M
        left.remove(got[0][0])
        order.append(got[0][0])
    assert order == ["t1", "t2", "t3", "t4", "t0"]


RA_SHARDS = {"t0": ["a"], "t1": ["a"], "t2": ["a"], "t3": ["b"], "t4": ["b"], "t5": ["b"], "t6": ["a", "b"]}
REPLICA_AWARE_MAINTENANCE = {  # request, min_live → choices  (a: t0 t1 t2 t6, b: t3 t4 t5 t6)
    "long-moves-while-replicas-stay": (notice_req(["t0", "t1", "t2"]), 2, [("t0", M), ("t1", M)]),
    "long-never-keeps": (notice_req(["t3"]), 3, [("t3", M)]),
    "long-left-for-later-when-short-of-replicas": (notice_req(["t0"], unhealthy=["t1", "t2"]), 2, []),
    "short-keeps-with-replicas-elsewhere": (notice_req(["t0", "t3"], SHORT), 2, [("t0", K), ("t3", K)]),
    "short-but-replicas-under-notice-too": (notice_req(["t0", "t1", "t2"], SHORT), 2, [("t0", M), ("t1", M)]),
    "unsaid-duration-is-long": (notice_req(["t0"], None), 2, [("t0", M)]),
    "a-down-task-moves": (notice_req(["t0"], unhealthy=["t0", "t1", "t2"]), 2, [("t0", M)]),
    "updates-count-first": (notice_req(["t0", "t1"], pending=["t2"]), 2, [("t0", M)]),
}


@pytest.mark.parametrize("request_, min_live, choices", REPLICA_AWARE_MAINTENANCE.values(),
                         ids=REPLICA_AWARE_MAINTENANCE)
def test_replica_aware_maintenance_choices(request_, min_live, choices):
    got = ReplicaAware(RA_SHARDS, min_live)(request_, view())
    assert chosen(got) == choices
    # whatever it moved or approved leaves every shard at least min_live live replicas (or as many as it had)
    down = set(request_.unhealthy) | set(tasks_of(got)) | {t for t, c in chosen(got) if c == M}
    before = set(request_.unhealthy)
    for shard in ("a", "b"):
        live = sum(shard in h for t, h in RA_SHARDS.items() if t not in down)
        had = sum(shard in h for t, h in RA_SHARDS.items() if t not in before)
        assert live >= min(min_live, had)


PACING_MAINTENANCE = {  # load, duration, unhealthy, in flight → choices of 4 tasks under notice
    "short-keeps-all": (0.9, SHORT, [], 0, [("t0", K), ("t1", K), ("t2", K), ("t3", K)]),
    "long-off-peak-moves-fast": (0.2, LONG, [], 0, [("t0", M), ("t1", M), ("t2", M), ("t3", M)]),
    "long-normal-moves-two": (0.6, LONG, [], 0, [("t0", M), ("t1", M)]),
    "long-peak-moves-one": (0.9, LONG, [], 0, [("t0", M)]),
    "down-tasks-count": (0.6, LONG, ["x1"], 0, [("t0", M)]),
    "in-flight-counts": (0.6, LONG, [], 2, []),
    "a-down-task-moves-anyway": (0.9, LONG, ["t2"], 1, [("t2", M)]),
}


@pytest.mark.parametrize("load, duration, unhealthy, flying, choices", PACING_MAINTENANCE.values(),
                         ids=PACING_MAINTENANCE)
def test_pacing_maintenance_choices(load, duration, unhealthy, flying, choices):
    r = notice_req([f"t{i}" for i in range(4)], duration, unhealthy=unhealthy)
    assert chosen(Pacing(lambda: load)(r, view(*[f"x{i + 5}" for i in range(flying)]))) == choices


@pytest.mark.parametrize("keep_below_ms, choice", [(SHORT - 1, M), (SHORT, K)])
def test_the_keep_threshold_is_configurable(keep_below_ms, choice):
    r = notice_req(["t0"], SHORT)
    assert chosen(Pacing(lambda: 0.2, keep_below_ms=keep_below_ms)(r, view())) == [("t0", choice)]
    assert chosen(ReplicaAware({"t0": []}, 2, keep_below_ms)(r, view())) == [("t0", choice)]
