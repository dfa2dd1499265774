"""Reference TaskController processes run by a test (``python -m processors.taskcontrol.controllers KIND ...``)
beside a real scheduler shard, and the marker that such a region has settled (``settle``): every process has read
and acted on everything on the log, so nothing more will come of what the test did. A test asserts that something
did *not* happen after ``settle``, never after a fixed sleep (which passes when the unwanted event is merely slow).

A controller reads ``taskcontrol`` without a consumer group; it serves how far it has read and acted (its acks
flushed) as ``ropewalk_reader_position`` on its metrics endpoint (infra/metrics.py, served because the test names
the worker as the supervisor would). The scheduler's consumer group commits a batch's records only after its
output is flushed, so its committed offsets say the same of it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from infra.config import PROJECT_ROOT
from infra.process import die_with_parent
from processes import worker_metrics
from processors.scheduler.shard import APP_ID, SOURCES
from streams import groups
from streams.clients import consumer_conf
from streams.topics import Topics

POSITION = "ropewalk_reader_position"


class Controller:
    """One controller process (its own run dir, its log in ``log_path``), killed with its session."""

    def __init__(self, cfg, run_dir: Path, log_path: Path, kind: str, *args: str, name: str):
        self.cfg, self.run_dir, self.log_path, self.worker = cfg, run_dir, log_path, f"controller-{name}"
        env = {**os.environ, "ROPEWALK_BOOTSTRAP_SERVERS": cfg.bootstrap_servers, "ROPEWALK_REDIS_URL": cfg.redis_url,
               "ROPEWALK_TOPIC_PREFIX": cfg.topic_prefix, "ROPEWALK_PARTITIONS": str(cfg.partitions),
               "ROPEWALK_RUN_DIR": str(run_dir), "ROPEWALK_WORKER_NAME": self.worker}
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "processors.taskcontrol.controllers", kind,
                                          "--name", name, *args], cwd=PROJECT_ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=die_with_parent)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def position(self) -> dict[tuple[str, int], int]:
        """``{(physical topic, partition): next offset}`` it has read and acted on; {} before it serves any."""
        return {(self.cfg.topic_prefix + s.labels["topic"], int(s.labels["partition"])): int(s.value)
                for samples in worker_metrics(self.run_dir, self.worker).values() for s in samples
                if s.name == POSITION}


def _ends(cfg, topics: Iterable[str]) -> dict[tuple[str, int], int]:
    c = Consumer(consumer_conf(cfg, None))
    try:
        md = c.list_topics(timeout=10)
        return {(t, p): c.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
                for t in topics for p in sorted(md.topics[t].partitions)}
    finally:
        c.close()


def settle(cfg, reader, poll: Callable[[], object], controllers: Iterable[Controller] = (),
           timeout_s: float = 60.0) -> None:
    """Return once nothing more will come: in one pass, with the log's ends taken at its start, the scheduler's
    group has committed every source to its end, every live controller has read and acted on ``taskcontrol`` up to
    its end, and the test's ``reader`` (``reader.consumer``, an EventConsumer) has read its topics to their end,
    ``poll`` (which reads with it and plays the test's hands) having run on all of it; and the ends did not move
    during the pass. A controller that is not alive cannot add anything and is not waited for."""
    t = Topics(cfg.topic_prefix, cfg.partitions)
    sources = [t.name(n) for n in SOURCES]
    taskcontrol = t.name("taskcontrol")
    topics = sorted({*sources, *reader.consumer.physical_topics})
    deadline = time.monotonic() + timeout_s
    while True:
        poll()
        ends = _ends(cfg, topics)
        mine = {tp: off for tp, off in ends.items() if tp[0] in reader.consumer.physical_topics}
        behind = []
        if not reader.consumer.read_up_to(mine, {}):
            behind.append("the test's reader")
        elif groups.lag(cfg, cfg.topic_prefix + APP_ID, sources) > 0:
            behind.append("the scheduler")
        else:
            for c in controllers:
                if c.alive():
                    pos = c.position()
                    if any(pos.get(tp, 0) < off for tp, off in ends.items() if tp[0] == taskcontrol and off > 0):
                        behind.append(c.worker)
        if not behind and _ends(cfg, topics) == ends:
            return
        assert time.monotonic() < deadline, f"not settled after {timeout_s:.0f}s: {behind or 'the log grew'}"
