"""Records written to the log over a phase of the bench, counted per topic, per producer (the ``producer`` record
header every ``EventProducer`` sets; faust's table changelogs carry none and count as ``changelog``) and per event
type: what each hop of a job's path writes. Two ``topic_ends`` readings around a phase, then ``records_between``
reads the records written in between back (after the phase, outside its timing) and counts them.

Heartbeats are counted apart (``background``): the agents send them at a fixed rate whatever the jobs do, so their
number per job says how long the phase took, not what a job costs.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

from confluent_kafka import Consumer, TopicPartition

from infra.config import Config
from streams.clients import PRODUCER_HEADER, TYPE_HEADER, consumer_conf, header

BACKGROUND = frozenset({"heartbeats"})  # topics written at a fixed rate, not per job
READ_TIMEOUT_S = 120.0


def topic_ends(cfg: Config) -> dict[tuple[str, int], int]:
    """The end offset of every partition of every topic of the region (its prefix: faust's changelogs included)."""
    c = Consumer(consumer_conf(cfg, None))
    try:
        md = c.list_topics(timeout=10)
        return {(name, p): c.get_watermark_offsets(TopicPartition(name, p), timeout=10)[1]
                for name, t in md.topics.items() if name.startswith(cfg.topic_prefix) for p in t.partitions}
    finally:
        c.close()


def records_between(cfg: Config, before: dict[tuple[str, int], int], after: dict[tuple[str, int], int],
                    per: int = 1, since_ms: int | None = None) -> dict[str, Any]:
    """The records written between two ``topic_ends`` readings, divided by ``per`` (the phase's jobs): by topic and
    producer (``"<topic> <- <producer>"``), by producer and type, in all (``total``, heartbeats left out) and the
    heartbeats (``background``). Read back from the log. With ``since_ms`` (a phase's start, epoch ms), also the
    ``timeline``: per producer and type, the log times of its first and last record, in ms after it."""
    todo = {tp: (before.get(tp, 0), end) for tp, end in after.items() if end > before.get(tp, 0)}
    by_topic: Counter[tuple[str, str]] = Counter()
    by_type: Counter[tuple[str, str]] = Counter()
    times: dict[tuple[str, str], list[int]] = {}
    c = Consumer(consumer_conf(cfg, None, **{"enable.partition.eof": False}))
    try:
        if todo:
            c.assign([TopicPartition(t, p, lo) for (t, p), (lo, _) in todo.items()])
        left = set(todo)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while left and time.monotonic() < deadline:
            for m in c.consume(10000, 0.5):
                tp = (m.topic(), m.partition())
                if m.error() is not None or tp not in left:
                    continue
                if m.offset() + 1 >= todo[tp][1]:
                    left.discard(tp)
                    c.pause([TopicPartition(*tp)])
                if m.offset() >= todo[tp][1]:
                    continue
                topic = m.topic()[len(cfg.topic_prefix):]
                producer = header(m.headers(), PRODUCER_HEADER)
                type_ = header(m.headers(), TYPE_HEADER)
                who = producer.decode() if producer else ("changelog" if topic.endswith("-changelog") else "?")
                by_topic[(topic, who)] += 1
                what = (who, type_.decode() if type_ else topic)
                by_type[what] += 1
                if since_ms is not None:
                    t = m.timestamp()[1] - since_ms
                    first_last = times.setdefault(what, [t, t])
                    first_last[0], first_last[1] = min(first_last[0], t), max(first_last[1], t)
    finally:
        c.close()
    jobs = max(1, per)
    return {"by_topic": {f"{t} <- {p}": round(n / jobs, 3) for (t, p), n in sorted(by_topic.items())},
            "by_type": {f"{p}: {t}": round(n / jobs, 3) for (p, t), n in sorted(by_type.items())},
            "total": round(sum(n for (t, _), n in by_topic.items() if t not in BACKGROUND) / jobs, 3),
            "background": round(sum(n for (t, _), n in by_topic.items() if t in BACKGROUND) / jobs, 3),
            "complete": not left,
            **({"timeline": {f"{p}: {t}": fl for (p, t), fl in sorted(times.items(), key=lambda kv: kv[1][0])}}
               if since_ms is not None else {})}
