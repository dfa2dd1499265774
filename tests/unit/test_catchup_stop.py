"""A worker told to stop while it catches up stops within a poll (``streams.catchup.read_to_end``'s ``stop``), and
decides nothing from its partial fold (``processors.worker.LoopWorker.begin``). The loop over a scripted reader: the
reader stands in for a consumer of a partition far longer than the test reads (the real ones: test_catchup)."""
import pytest

from processors.worker import LoopWorker
from streams.catchup import CatchUpStopped, read_to_end
from streams.clients import Record

TP = ("t.machines", 0)
END = 10**9  # the partition's end: never reached here


class EndlessPartition:
    """What ``read_to_end`` asks of a consumer, over a partition of END records: each poll hands the next batch."""

    name = "endless"

    def __init__(self, batch: int = 100):
        self.batch, self.next, self.polls = batch, 0, 0
        self.eof: set = set()
        self.dead_lettered = 0

    def partitions(self):
        return [TP]

    def watermarks(self):
        return {TP: (0, END)}

    def fetched_high_watermark(self, tp):
        return END

    def poll(self, max_records, timeout_s):
        self.polls += 1
        out = [Record(event=None, topic=TP[0], partition=TP[1], offset=o, key=None,
                      log_timestamp_ms=0)
               for o in range(self.next, self.next + self.batch)]
        self.next += self.batch
        return out


class Worker(LoopWorker):
    """A worker whose start is a catch-up of ``reader``, told to stop after ``stop_after`` batches."""

    def __init__(self, reader: EndlessPartition, stop_after: int | None):
        self.reader, self.stop_after = reader, stop_after
        self.batches = self.steps = 0
        self.closed = False

    def fold(self, records) -> None:
        self.batches += 1
        if self.batches == self.stop_after:
            self.stop()  # as the SIGTERM handler does, from within the catch-up

    def start(self) -> None:
        read_to_end(self.reader, self.fold, stop=self.stopping)

    def step(self) -> None:
        self.steps += 1

    def close(self) -> None:
        self.closed = True

    def run(self) -> None:
        if self.begin(self.start):
            self.loop()


@pytest.mark.parametrize("stop_after", [1, 3, 50])
def test_a_stop_during_catch_up_ends_it_at_the_next_poll(stop_after):
    reader = EndlessPartition()
    w = Worker(reader, stop_after)
    w.run()
    assert reader.polls == stop_after  # not one poll more
    assert w.closed and w.steps == 0  # closed, and no step decided from the partial fold


def test_a_stop_before_catch_up_reads_nothing():
    reader = EndlessPartition()
    with pytest.raises(CatchUpStopped, match="endless: stopped while catching up, after 0 records"):
        read_to_end(reader, lambda recs: None, stop=lambda: True)
    assert reader.polls == 0


def test_without_a_stop_the_catch_up_reads_to_the_end():
    small = 35

    class Short(EndlessPartition):
        def watermarks(self):
            return {TP: (0, small)}

        def fetched_high_watermark(self, tp):
            return small

    reader = Short(batch=10)
    assert read_to_end(reader, lambda recs: None, stop=lambda: False) == 40  # 4 batches: the one past the end too
    assert reader.polls == 4
