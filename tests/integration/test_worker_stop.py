"""A worker told to stop (SIGTERM's handler: ``LoopWorker.stop``) while it catches up with a real broker's log stops
at its next poll: it neither reads the rest nor goes live, and it is closed (``read_to_end``'s ``stop``)."""
from __future__ import annotations

import threading

from processors.follower import Follower
from streams.catchup import POLL_MAX
from streams.clients import EventProducer
from streams.events import new_event

N = POLL_MAX + 5000  # more than one poll can hand over


class Folder(Follower):
    NAME = "test-folder"
    TOPICS = ("state.jobs",)
    TYPES = frozenset({"JobStatePublished"})

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.folded = 0
        self.first_batch = threading.Event()  # the catch-up has begun
        self.go_on = threading.Event()  # the test has asked the stop
        self.closed = False

    def handle(self, records, live):
        self.folded += len(records)
        self.first_batch.set()
        self.go_on.wait(60)  # held in the catch-up until the stop was asked
        return []

    def close(self):
        self.closed = True
        super().close()


def test_a_worker_stopped_during_its_catch_up_stops_at_the_next_poll(cfg, registry):
    producer = EventProducer(cfg, registry, "test")
    for i in range(N):
        producer.send(new_event("JobStatePublished", {
            "job_id": f"e1.j{i}", "name": f"j{i}", "state": "running", "spec_version": 1, "desired_tasks": 0,
            "tasks": []}, entitlement="e1", entity_id=f"e1.j{i}", producer="test"))
    producer.flush()
    worker = Folder(cfg, registry=registry)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    assert worker.first_batch.wait(120), "the catch-up never began"
    worker.stop()  # what SIGTERM does (stop_on_signals)
    worker.go_on.set()
    t.join(60)
    assert not t.is_alive(), "the worker went on catching up after it was told to stop"
    assert worker.closed and not worker.live
    assert 0 < worker.folded < N  # it stopped before the end of the log
