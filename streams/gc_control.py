"""The cyclic garbage collector around bulk folds of the log.

A fold of a whole log (the allocator's start, ``ropewalk rebuild``, the Resource Broker's and the health check's
catch-up) allocates millions of objects that live on: the machines, their tasks, the placement index, the decoded
records waiting to be merged. CPython's collector runs a full collection every time the long-lived objects grew by
a quarter, walking all of them each time: in a cProfile of a rebuild at 100,000 machines a quarter of the read's
time showed up inside whatever C call happened to trigger a collection. Nothing a fold builds is cyclic garbage.

``folding()`` pauses the collector for the fold, and with ``freeze=True`` moves what exists at its end into the
permanent generation (``gc.freeze``), so a long-running process's later collections no longer walk the region it
holds (a full collection of a 100,000-machine fold is a latency spike on every decision path). Reference counting
frees garbage as ever; only cycles among frozen objects would be kept, and folds make none.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def folding(*, freeze: bool = False) -> Iterator[None]:
    """The cyclic collector paused inside (restored as it was after); with ``freeze``, what exists at the end is
    moved out of its reach (``gc.freeze``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was_enabled:
            gc.enable()


class GrowthFreezer:
    """For state that grows while a process runs (a region registering after the allocator started, say): each
    time the state has grown by ``GROWTH`` since the last freeze, what exists is frozen (``gc.freeze``). The full
    collections the growth would trigger (one each time the long-lived objects grew by a quarter, each walking
    all of them: seconds at a million machines, during which faust's consumer thread could not send the group
    heartbeat and the allocator lost its partitions) then walk only what came since."""

    GROWTH = 1.2
    FLOOR = 10_000  # below this many items the collector's walks cost nothing worth a freeze

    def __init__(self) -> None:
        self.frozen_at = 0

    def grew(self, size: int) -> bool:
        """Freeze if ``size`` (items of the state: machines, say) passed the next mark; whether it did."""
        if size < max(self.FLOOR, self.frozen_at * self.GROWTH):
            return False
        gc.freeze()
        self.frozen_at = size
        return True
