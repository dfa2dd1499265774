"""Snapshots of the allocator's fold (processors/allocator/snapshot.py): what a snapshot gives back is the fold it was
taken of, and a snapshot that cannot serve this region is set aside. Files under a temporary run directory; the
reading of the log's tail after a snapshot is tested on the real broker (tests/integration/test_allocator_processor.py)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from allocator_log import SEQUENCES, Log, allocated, reg, requested, state, status
from processors.allocator import snapshot
from processors.allocator.fold import ADOPTED_FIELDS, ALLOCATOR_PRODUCER, RegionFold
from processors.allocator.placement import Entitlement, Request
from streams.events import Event


def cfg_of(tmp_path, prefix="t1.", partitions=4):
    return SimpleNamespace(run_dir=tmp_path, topic_prefix=prefix, partitions=partitions)


def folded(events) -> tuple[RegionFold, Log]:
    fold, log = RegionFold(), Log()
    for e in events:
        fold.apply(*log.add(e))
    return fold, log


def decided_by_allocator(event: Event, cause: str) -> Event:
    return Event(**{**event.__dict__, "producer": ALLOCATOR_PRODUCER, "causation_id": cause})


def everything_of(fold: RegionFold) -> dict:
    return {"state": state(fold), "decided": list(fold.decided), "last_applied": fold.last_applied,
            "entitlements": fold.entitlements, "job_tasks": dict(fold.job_tasks), "statuses": +fold.statuses,
            "applied": fold.applied}


@pytest.mark.parametrize("events", [events for events, _ in SEQUENCES.values()], ids=SEQUENCES.keys())
def test_a_snapshot_gives_back_the_fold_it_was_taken_of(tmp_path, events):
    fold, _ = folded(events)
    cfg = cfg_of(tmp_path)
    snapshot.write(cfg, fold, [], records=len(events))
    loaded = snapshot.newest(cfg)
    assert loaded is not None and everything_of(loaded.fold) == everything_of(fold)
    assert loaded.verify == fold.last_applied


def test_a_loaded_fold_decides_as_the_fold_it_was_taken_of_and_keeps_its_open_requests(tmp_path):
    events = [reg(f"m{i}", msb=f"msb{i % 3}", rack=f"r{i % 5}") for i in range(12)]
    events += [status("m3", "DOWN"), requested("r1", "e1", ["a/0", "a/1"], job="a"),
               decided_by_allocator(allocated("r1", "e1", [("a/0", "m1"), ("a/1", "m2")], ["m1", "m2"], job="a"),
                                    "request-1"),
               requested("r2", "e1", ["b/0", "b/1", "b/2"], job="b")]
    fold, _ = folded(events)
    cfg = cfg_of(tmp_path)
    open_request = events[-1]
    snapshot.write(cfg, fold, [(open_request, 2)], records=len(events))
    loaded = snapshot.newest(cfg)
    assert loaded is not None
    assert [(e.event_id, e.payload, p) for e, p in loaded.pending] == [(open_request.event_id, open_request.payload, 2)]
    assert loaded.fold.is_decided("request-1") and not loaded.fold.is_decided(open_request.event_id)
    ent = Entitlement("e1", quota_machines=8)
    req = Request(request_id="r2", job_id="b", entitlement="e1", task_ids=("b/0", "b/1", "b/2"), cpu=1000, mem=1024,
                  spread="rack")
    assert loaded.fold.place(ent, req) == fold.place(ent, req)


def test_a_fold_ahead_of_the_log_is_not_snapshotted_until_its_decisions_are_read_back(tmp_path):
    fold, log = folded([reg("m1"), requested("r1", "e1", ["j/0"])])
    decision = decided_by_allocator(allocated("r1", "e1", [("j/0", "m1")], ["m1"]), "request-1")
    assert fold.commit([("j/0", "m1")], ["m1"], "e1", 1000, 1024, {"m1": 1}, "request-1").ok
    fold.remember_made([decision])
    with pytest.raises(snapshot.SnapshotError, match="ahead of the log"):
        snapshot.write(cfg_of(tmp_path), fold, [], records=2)
    fold.apply(*log.add(decision))  # its echo
    assert fold.as_logged
    snapshot.write(cfg_of(tmp_path), fold, [], records=3)


def test_a_fold_that_took_a_machine_from_the_shared_index_is_not_snapshotted(tmp_path):
    """``adopt`` (another allocator's commit, read from Redis) may hold what never reaches the log: a snapshot of it
    would be given to the next start as if logged (the kill storm, stop 43). Such a fold is never snapshotted."""
    fold, _ = folded([reg("m1"), reg("m2")])
    m = fold.machines["m1"]
    fields = {name: getattr(m, name) for name in ADOPTED_FIELDS}
    assert fold.adopt("m1", {**fields, "tasks": {"j/0": (1000, 1024)}, "status": m.status, "version": m.version + 1})
    assert not fold.as_logged
    with pytest.raises(snapshot.SnapshotError, match="ahead of the log"):
        snapshot.write(cfg_of(tmp_path), fold, [], records=2)


REFUSED = {
    # name: (what is written where the snapshot is, the reason it is set aside)
    "another topic prefix": (lambda tmp: snapshot.write(cfg_of(tmp, prefix="other."), folded([reg("m1")])[0], [],
                                                        records=1).rename(snapshot.directory(cfg_of(tmp)) / "9.snap"),
                             "made under another topic_prefix"),
    "other partitions": (lambda tmp: snapshot.write(cfg_of(tmp, partitions=8), folded([reg("m1")])[0], [],
                                                    records=1), "made under another partitions"),
    "garbage": (lambda tmp: (snapshot.directory(cfg_of(tmp)) / "9.snap").write_bytes(b"\x00not json"), "unreadable"),
    "a part of another shape": (lambda tmp: other_shape(snapshot.write(cfg_of(tmp), folded([reg("m1")])[0], [],
                                                                       records=1)), "unreadable"),
    "cut short": (lambda tmp: cut_short(snapshot.write(cfg_of(tmp), folded([reg("m1")])[0], [], records=1)),
                  "unreadable"),
}


def other_shape(path):
    head, *rest = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([head, *rest[:-1], b'{"requests": [], "entitlements": 3, "decided": 4, "pending": 5}']))


def cut_short(path):
    path.write_bytes(path.read_bytes()[:-20])


@pytest.mark.parametrize("make,why", REFUSED.values(), ids=REFUSED.keys())
def test_a_snapshot_that_cannot_serve_is_set_aside_and_an_older_one_used(tmp_path, make, why, caplog):
    cfg = cfg_of(tmp_path)
    good, _ = folded([reg("m1"), reg("m2")])
    first = snapshot.write(cfg, good, [], records=2)
    os.utime(first, (1, 1))
    first = first.rename(first.with_name("0" + first.name))  # the oldest by name
    make(tmp_path)
    loaded = snapshot.newest(cfg)
    assert loaded is not None and loaded.path == first and set(loaded.fold.machines) == {"m1", "m2"}
    assert why in caplog.text and list(snapshot.directory(cfg).glob("*.bad"))


def test_the_newest_snapshots_are_kept_and_the_older_deleted(tmp_path):
    cfg = cfg_of(tmp_path)
    fold, log = folded([reg("m1")])
    for i in range(2, 6):
        fold.apply(*log.add(reg(f"m{i}")))
        snapshot.write(cfg, fold, [], records=i)
    kept = snapshot.listing(cfg)
    assert len(kept) == snapshot.KEEP and sorted(snapshot.load(cfg, kept[-1]).fold.machines) == [f"m{i}" for i in
                                                                                                range(1, 6)]


def test_a_snapshot_is_written_by_a_child_process(tmp_path):
    cfg = cfg_of(tmp_path)
    fold, _ = folded([reg(f"m{i}") for i in range(50)])
    pid = snapshot.write_in_child(cfg, fold, [], records=50)
    assert pid != os.getpid()
    _, status_ = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status_) == 0
    assert len(snapshot.load(cfg, snapshot.listing(cfg)[-1]).fold.machines) == 50


def test_a_snapshot_being_written_is_not_read(tmp_path, monkeypatch):
    """The writer's temporary file (a child still writing, or one killed half-way) is never taken for a snapshot:
    what a reader lists just before the rename is the snapshots before it alone."""
    cfg = cfg_of(tmp_path)
    fold, _ = folded([reg("m1")])
    first = snapshot.write(cfg, fold, [], records=1)
    listed = []
    real = os.replace

    def spy(src, dst):
        listed.append(snapshot.listing(cfg))
        return real(src, dst)
    monkeypatch.setattr(snapshot.os, "replace", spy)
    second = snapshot.write(cfg, fold, [], records=2)
    assert listed == [[first]] and snapshot.listing(cfg) == [first, second]
