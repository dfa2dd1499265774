"""A job kept as a header and bounded chunks (processors/scheduler/store.py): read back equal, only changed chunks
written, every record bounded, and no crash point of the write order leaves a half-written job."""
import json
from dataclasses import replace
from types import MappingProxyType

import pytest

from processors.scheduler import lifecycle as lc
from processors.scheduler import records
from processors.scheduler import work
from processors.scheduler import store as st
from processors.scheduler.decide import machines_of
from processors.scheduler.model import Job, Maintenance, Spec, Task, Terms
from test_scheduler_decide import report, resized, running_job  # the scheduler tests' harness

SPEC = Spec(name="big", command=("sleep", "3600"), cpu=100, mem=64)


def big_job(n, job_id="e1.big"):
    """``n`` tasks RUNNING on machines of a few racks (built directly: the shape, not the history, matters)."""
    tasks = {}
    for i in range(n):
        tid = f"{job_id}/{i}"
        tasks[tid] = Task(id=tid, index=i, state=lc.RUNNING, machine=f"dc1-msb{i % 20}-r{i % 7:02d}-m{i % 50:03d}",
                          dc="dc1", msb=f"msb{i % 20}", rack=f"r{i % 7:02d}", terms=Terms(100, 64), discovery=True,
                          running_since_ms=1_700_000_000_000)
    return Job(id=job_id, entitlement="e1", spec=SPEC, spec_version=1, desired=n, tasks=MappingProxyType(tasks),
               seen=tuple(f"event-{i:08d}-aaaa-bbbb-cccc-dddddddddddd" for i in range(work.SEEN_LIMIT)))


def write(chunks: dict, plan: st.Plan, headers: dict | None = None):
    """Apply a plan to a chunk table (and a header table), as the shard does in its three steps."""
    chunks.update(plan.chunks)
    if headers is not None:
        headers[plan.header["id"]] = plan.header
    for key in plan.obsolete:
        chunks.pop(key, None)


def test_a_job_read_back_from_its_header_and_chunks_is_the_same_job():
    sim = running_job(3)
    sim.feed(resized("j", 5))
    job = sim.state.jobs["j"]
    plan = st.plan(None, None, {}, job)
    header, chunks = json.loads(json.dumps(plan.header)), json.loads(json.dumps(plan.chunks))  # as JSON values
    assert st.job_of(header, chunks) == job
    assert list(chunks) == ["j#0@1"] and header["chunks"] == {"0": 1} and "tasks" not in header


def test_the_older_whole_job_record_is_still_read_and_rewritten_in_chunks():
    job = running_job(3).state.jobs["j"]
    old = json.loads(json.dumps(records.job_to_record(job)))
    assert st.job_of(old, {}) == job
    plan = st.plan(job, old, {}, job)
    assert set(plan.chunks) == {"j#0@1"} and plan.obsolete == []


def test_a_20000_task_job_is_40_records_of_bounded_size():
    job = big_job(20_000)
    plan = st.plan(None, None, {}, job)
    sizes = sorted(len(json.dumps(v)) for v in plan.chunks.values())
    assert len(plan.chunks) == 40 and sizes[-1] < 200_000  # the whole job was 8.7 MB in one record
    assert len(json.dumps(plan.header)) < 100_000
    assert st.job_of(plan.header, plan.chunks) == job


CHANGES = {  # what a decision does to a 1,200-task job -> chunks written, chunks gone from the header
    "one task's state": (lambda j: _put(j, replace(j.tasks["e1.big/7"], state=lc.FAILED)), {0}, set()),
    "two tasks in two chunks": (lambda j: _put(_put(j, replace(j.tasks["e1.big/7"], state=lc.FAILED)),
                                               replace(j.tasks["e1.big/1100"], state=lc.FAILED)), {0, 2}, set()),
    "job fields only (the duplicate ring)": (lambda j: replace(j, seen=(*j.seen[1:], "new")), set(), set()),
    "a task added in a new chunk": (lambda j: _put(j, Task(id="e1.big/1500", index=1500)), {3}, set()),
    "the last chunk emptied": (lambda j: _drop(j, [f"e1.big/{i}" for i in range(1000, 1200)]), {2}, {2}),
}


def _put(job, t):
    return replace(job, tasks=MappingProxyType({**job.tasks, t.id: t}))


def _drop(job, tids):
    return replace(job, tasks=MappingProxyType({k: t for k, t in job.tasks.items() if k not in set(tids)}))


@pytest.mark.parametrize("change, written, dropped", CHANGES.values(), ids=CHANGES)
def test_only_the_chunks_a_decision_changed_are_written(change, written, dropped):
    before = big_job(1_200)
    chunks, headers = {}, {}
    write(chunks, st.plan(None, None, {}, before), headers)
    header = headers[before.id]
    after = change(before)
    plan = st.plan(before, header, chunks, after)
    assert {int(k.split("#")[1].split("@")[0]) for k in plan.chunks} == written - dropped
    version = header["version"] + (1 if written else 0)
    assert all(k.endswith(f"@{version}") for k in plan.chunks) and plan.header["version"] == version
    assert sorted(plan.obsolete) == sorted(f"e1.big#{i}@1" for i in written if i in (0, 1, 2))
    assert set(map(int, plan.header["chunks"])) == ({0, 1, 2} | written) - dropped
    for key, value in plan.chunks.items():  # unchanged tasks' records are the very records read
        old = chunks.get(key.replace(f"@{version}", "@1"))
        if old is not None:
            reused = sum(1 for r in value["tasks"] if any(r is o for o in old["tasks"]))
            assert reused == len(value["tasks"]) - sum(1 for r in value["tasks"]
                                                       if before.tasks.get(r["id"]) is not after.tasks.get(r["id"]))
    write(chunks, plan, headers)
    assert st.job_of(headers[after.id], chunks) == after
    assert st.orphans(chunks, headers) == []


# -- the delivery argument: a crash at any point of the write order -------------------------------------------------

def phases(plan: st.Plan):
    """The shard's writes as (table, key, value), in its three steps: chunks | header | tombstones. A flush ends
    the first two: every write of a step is on the log before any of the next one."""
    return ([("chunk", k, v) for k, v in plan.chunks.items()], [("header", plan.header["id"], plan.header)],
            [("chunk", k, None) for k in plan.obsolete])


def subsets(writes):
    return [[w for i, w in enumerate(writes) if mask >> i & 1] for mask in range(2 ** len(writes))]


def test_a_crash_at_any_point_leaves_the_old_job_or_the_new_one():
    """What a successor recovers from the changelog after a crash: every step before the crash whole, and any
    subset of the crashed step's writes (within a step, records may reach the log in any order)."""
    sim = running_job(3)
    old_job = sim.state.jobs["j"]
    chunks, headers = {}, {}
    write(chunks, st.plan(None, None, {}, old_job), headers)
    sim.feed(report("j/1", "FAILED", "m2", exit_code=1))
    sim.feed(resized("j", 700))  # a second chunk appears, the first changes
    new_job = sim.state.jobs["j"]
    plan = st.plan(old_job, headers["j"], chunks, new_job)
    assert len(plan.chunks) == 2 and len(plan.obsolete) == 1
    steps = phases(plan)
    outcomes = []
    for crashed in range(len(steps)):
        for partial in subsets(steps[crashed]):
            c, h = dict(chunks), dict(headers)
            for table, key, value in [w for step in steps[:crashed] for w in step] + partial:
                target = c if table == "chunk" else h
                if value is None:
                    target.pop(key, None)
                else:
                    target[key] = value
            job = st.job_of(h["j"], c)  # never a MissingChunk
            assert job in (old_job, new_job)
            outcomes.append(job == new_job)
            garbage = set(plan.obsolete) if job == new_job else set(plan.chunks)
            assert set(st.orphans(c, h)) <= garbage  # what the timer deletes: never a chunk the job needs
    assert len(outcomes) == 4 + 2 + 2 and set(outcomes) == {False, True}


def test_orphans_are_the_chunks_no_header_names():
    headers = {"a": {"id": "a", "chunks": {"0": 2, "1": 1}}, "b": {"id": "b", "tasks": []}}
    keys = ["a#0@1", "a#0@2", "a#1@1", "a#2@3", "b#0@1", "c#0@1"]
    assert st.orphans(keys, headers) == ["a#0@1", "a#2@3", "b#0@1", "c#0@1"]


def test_a_header_naming_a_missing_chunk_is_an_error_not_a_silent_loss():
    plan = st.plan(None, None, {}, running_job(2).state.jobs["j"])
    with pytest.raises(st.MissingChunk, match="names chunk 0 at version 1"):
        st.job_of(plan.header, {})


# -- the machine index: derived from the stored jobs, kept in step by writes ------------------------------------

def stored(*jobs):
    """The jobs table and chunk table holding ``jobs`` (as JSON values, as the tables hold them)."""
    headers, chunks = {}, {}
    for job in jobs:
        write(chunks, st.plan(None, None, chunks, job), headers)
    return json.loads(json.dumps(headers)), json.loads(json.dumps(chunks))


def index_of(idx: st.MachineJobs, keys):
    return {k: sorted(idx.jobs(*k)) for k in keys if idx.jobs(*k)}


def test_the_machine_index_built_from_the_tables_equals_the_one_kept_in_step_by_writes():
    a = running_job(3, machines=("m1", "m2", "m3"), job="a").state.jobs["a"]
    b = running_job(2, machines=("m2", "m4", "m9"), job="b").state.jobs["b"]
    other = replace(big_job(3, "e2.c"), entitlement="e2")
    headers, chunks = stored(a, b, other)
    built = st.MachineJobs()
    assert not built.built and built.jobs("e1", "m2") == set()  # not built: nothing, the caller builds it
    built.build(headers, chunks)
    keys = [(e, m) for e in ("e1", "e2") for m in ("m1", "m2", "m3", "m4", "m9", *machines_of(other))]
    assert index_of(built, keys) == {("e1", "m1"): ["a"], ("e1", "m2"): ["a", "b"], ("e1", "m3"): ["a"],
                                     ("e1", "m4"): ["b"],
                                     **{("e2", m): ["e2.c"] for m in machines_of(other)}}
    # b's task on m4 moves to m9 and a leaves m1: the index kept in step equals one built from the new tables
    moved = replace(b, tasks=MappingProxyType({**b.tasks, "b/1": replace(b.tasks["b/1"], machine="m9")}))
    shrunk = replace(a, tasks=MappingProxyType({k: t for k, t in a.tasks.items() if t.machine != "m1"}))
    for before, after in ((b, moved), (a, shrunk)):
        built.update(after.id, after.entitlement, machines_of(before), machines_of(after))
    fresh = st.MachineJobs()
    fresh.build(*stored(shrunk, moved, other))
    assert index_of(built, keys) == index_of(fresh, keys)
    assert built.jobs("e1", "m1") == set() and built.jobs("e1", "m9") == {"b"}
    # a remembers a maintenance of m1 and m7 its tasks left: its end still concerns a (decide.machines_of)
    noticed = replace(shrunk, maint=(Maintenance("ue1", ("m1", "m7"), 0, 10, True),))
    built.update(noticed.id, noticed.entitlement, machines_of(shrunk), machines_of(noticed))
    fresh = st.MachineJobs()
    fresh.build(*stored(noticed, moved, other))
    assert index_of(built, keys + [("e1", "m7")]) == index_of(fresh, keys + [("e1", "m7")])
    assert fresh.jobs("e1", "m1") == fresh.jobs("e1", "m7") == {"a"}


def test_the_machine_index_reads_the_older_whole_job_record_and_is_rebuilt_after_forget():
    job = running_job(3, machines=("m1", "m2", "m3")).state.jobs["j"]
    old = json.loads(json.dumps(records.job_to_record(job)))  # a header in the older format: tasks inside
    idx = st.MachineJobs()
    idx.build({"j": old}, {})
    assert {m for m in ("m1", "m2", "m3") if idx.jobs("e1", m) == {"j"}} == {"m1", "m2", "m3"}
    idx.forget()
    idx.update("j", "e1", set(), {"m7"})  # a write while forgotten: the tables hold it, the next build reads it
    assert not idx.built and idx.jobs("e1", "m7") == set()
