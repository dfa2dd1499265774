"""The ReBalancer's view of the log (processors/rebalancer/view.py): scopes, no bounce, plans in flight, the plan
event and what `ropewalk rebalance plan` shows. Pure: events built by hand."""
from allocator_log import Log, allocated, deallocated, ev, reg, requested, status
from processors.rebalancer import solver
from processors.rebalancer import view as rv
from processors.rebalancer.solver import Goals, solve
from streams.serde import SchemaRegistry

REG = SchemaRegistry.from_dir()
T0 = 1_700_000_000_000
HOUR = 3_600_000


def created(name="e1"):
    return ev("EntitlementCreated", name, name, {"name": name, "quota_machines": 10, "machine_type": None,
                                                 "dc_pin": None, "host_profile": None})


def job_state(job, state, ent="e1", deleted=False):
    return ev("JobStatePublished", ent, job, {"job_id": job, "name": job, "state": state, "spec_version": 1,
                                              "desired_tasks": 1, "tasks": [], "last_reason": "", "deleted": deleted})


def at(e, ts):
    return e.__class__(**{**e.__dict__, "timestamp_ms": ts})


def hot_region():
    """e1 holds m1..m4 (4 cores each): job j has 4 tasks on m1 and one on each of m2..m4."""
    placed = [(f"j/{i}", "m1") for i in range(4)] + [("j/4", "m2"), ("j/5", "m3"), ("j/6", "m4")]
    return [created(), *(reg(f"m{i}", msb="msb1") for i in range(1, 5)),
            requested("r1", "e1", [t for t, _ in placed]),
            allocated("r1", "e1", placed, added=["m1", "m2", "m3", "m4"]), job_state("j", "running")]


def view_of(events):
    view, log = rv.RebalanceView(), Log()
    for e in events:
        view.apply(*log.add(e))
    return view, log


def test_the_scope_is_the_entitlements_machines_and_their_tasks():
    view, _ = view_of(hot_region())
    sc = view.scope("e1", T0)
    assert [m.id for m in sc.machines] == ["m1", "m2", "m3", "m4"]
    assert {m.id: m.cpu_used for m in sc.machines} == {"m1": 4000, "m2": 1000, "m3": 1000, "m4": 1000}
    assert all(t.movable is None for t in sc.tasks) and sc.jobs["j"].spread == "msb"
    assert view.due(T0) == ["e1"]


def test_tasks_of_a_job_not_running_or_on_a_machine_not_up_may_not_move():
    view, _ = view_of([*hot_region(), job_state("j", "updating"), status("m2", "DOWN", ent="e1")])
    sc = view.scope("e1", T0)
    reasons = {t.id: t.movable for t in sc.tasks}
    assert reasons["j/0"] == solver.TASK_JOB_NOT_RUNNING and reasons["j/4"] == solver.TASK_NOT_OPEN
    view, _ = view_of([*hot_region(), job_state("j", "running", deleted=True)])
    assert {t.movable for t in view.scope("e1", T0).tasks} == {solver.TASK_JOB_NOT_RUNNING}


def test_a_task_may_not_go_back_to_a_machine_it_left_within_the_hour():
    moved = [at(requested("r2", "e1", ["j/0"], free=["j/0"]), T0),
             at(deallocated("e1", [("j/0", "m1")], rid="r2"), T0),
             at(allocated("r2", "e1", [("j/0", "m2")]), T0)]
    view, _ = view_of([*hot_region(), *moved])
    banned = {t.id: t.banned for t in view.scope("e1", T0 + HOUR - 1).tasks}
    assert banned["j/0"] == frozenset({"m1"}) and banned["j/1"] == frozenset()
    assert {t.id: t.banned for t in view.scope("e1", T0 + HOUR).tasks}["j/0"] == frozenset()


def test_a_plan_in_flight_holds_its_entitlement_until_its_tasks_are_placed_again():
    view, log = view_of(hot_region())
    goals = Goals(target_ratio=1.1, trigger_ratio=1.15, max_move_fraction=0.5)
    plan = solve(view.scope("e1", T0), goals)
    assert plan.moves
    (event,) = view.plan_events(plan, goals, T0)
    REG.encode(event.type, event.to_record(schema_version=1))
    assert event.payload["plan_id"] == "e1:p1" and event.type == "RebalancePlanned"
    assert any("no bounce" in c for c in event.payload["constraints"])
    view.apply(event, None)
    assert view.due(T0) == [] and view.plans["e1"] == 1
    view.apply(*log.add(event))  # its echo from the log changes nothing
    assert view.plans["e1"] == 1
    for i, mv in enumerate(plan.moves):
        view.apply(*log.add(at(requested(f"m{i}", "e1", [mv.task_id], free=[mv.task_id]), T0 + 1)))
        view.apply(*log.add(at(allocated(f"m{i}", "e1", [(mv.task_id, mv.to_machine)]), T0 + 1)))
    assert view.due(T0 + 2) == ["e1"]
    assert view.plan_events(solve(view.scope("e1", T0 + 2), goals), goals, T0 + 2) == []  # balanced now


def test_a_plan_in_flight_expires():
    view, _ = view_of(hot_region())
    goals = Goals(max_move_fraction=0.5)
    (event,) = view.plan_events(solve(view.scope("e1", T0), goals), goals, T0)
    view.apply(event, None)
    assert view.due(T0 + rv.PLAN_TTL_MS - 1) == [] and view.due(T0 + rv.PLAN_TTL_MS) == ["e1"]


def test_what_rebalance_plan_shows():
    view, _ = view_of(hot_region())
    goals = Goals(max_move_fraction=0.5)
    (event,) = view.plan_events(solve(view.scope("e1", T0), goals), goals, T0)
    first, second = event.payload["moves"][:2]
    rows = {first["task_id"]: {"machine_id": first["to_machine_id"], "state": "RUNNING"},
            second["task_id"]: {"machine_id": second["from_machine_id"], "state": "RUNNING"}}
    shown = rv.plan_view(event, rows)
    progress = {m["task"]: m["progress"] for m in shown["moves"]}
    assert progress[first["task_id"]] == rv.MOVE_DONE and progress[second["task_id"]] == rv.MOVE_WAITING
    assert set(progress.values()) <= {rv.MOVE_DONE, rv.MOVE_WAITING, rv.MOVE_GONE}
    text = rv.format_plan(shown)
    assert "e1:p1" in text and first["task_id"] in text


def test_what_a_stopped_job_left_is_forgotten():
    """The view stays bounded under churn: a deleted job's rule goes with it, and departures out of the no-bounce
    window go at the next look for due entitlements, placed again or not."""
    moved = [at(requested("r2", "e1", ["j/0"], free=["j/0"]), T0),
             at(deallocated("e1", [("j/0", "m1")], rid="r2"), T0)]
    view, _ = view_of([*hot_region(), *moved, job_state("j", "stopped", deleted=True)])
    assert "j" not in view.rules and "j" not in view.job_state and view.left
    view.due(T0 + HOUR - 1)
    assert view.left  # within the window: kept
    view.due(T0 + HOUR)
    assert not view.left
