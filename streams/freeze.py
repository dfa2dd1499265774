"""Whether this process was frozen long enough to have lost its consumer group's partitions without knowing it.

A process stopped whole (SIGSTOP, a paused VM, a machine swapping) sends no heartbeats; past the session timeout
the group coordinator expires it and gives its partitions to another member. When it runs again it does not know
that yet: its consumer learns it from its next heartbeat's answer, a moment later, and in that moment the process
would decide on a batch it fetched before the freeze, on partitions another member owns now, and write its tables'
changelogs beside the new owner's (the kill storm's pauses found it: a shard woken after a 5.9 s SIGSTOP stored an
older offset over the new owner's, whose next recovery then held a stopped job STOPPING for good).

``FreezeWatch`` is the fence's other half, on the process's side: a thread ticks every ``tick_s`` and notes any gap
longer than ``threshold_s`` between two ticks (nothing but a frozen process stops a sleeping thread that long); from
such a wake until ``suspect_s`` later, or until the next assignment the group gives it (a rebalance completed after
the wake), the process is *suspect*: ``faustwire.tables_ready`` says no, so nothing is decided, and a decision under
way when the freeze began stops before its next write (``frozen_since``). If the group had expired it, its consumer
has heard so well before ``suspect_s`` has passed, and the rebalance under way keeps ``tables_ready`` false itself.
What stays open: records a producer had buffered before the freeze go out after it (Kafka transactions would fence
them; BENCHMARKS.md "Kafka transactions" says why the processors do not use them): they are of a decision made
while the process was the owner, and readers apply them idempotently.

The rule is pure (``FreezeRule``, a clock passed in: tests/unit/test_freeze.py); ``FreezeWatch`` adds the thread.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class FreezeRule:
    """What the ticks say. ``threshold_s``: a gap between ticks longer than this is a freeze; ``suspect_s``: how long
    after the wake the process stays suspect unless an assignment comes first."""

    threshold_s: float
    suspect_s: float
    last_tick: float
    woke_at: float | None = None  # the end of the last freeze not yet cleared by an assignment
    last_wake: float | None = None  # the end of the last freeze, assigned or not
    freezes: int = 0

    def tick(self, now: float) -> float | None:
        """A tick at ``now``; the length of the freeze it ends, if it ends one."""
        gap = now - self.last_tick
        self.last_tick = now
        if gap <= self.threshold_s:
            return None
        self.woke_at = self.last_wake = now
        self.freezes += 1
        return gap

    def assigned(self) -> None:
        """The group gave this process its partitions again after the wake: what it owns now is current."""
        self.woke_at = None

    def suspect(self, now: float) -> bool:
        """Whether the process may have lost partitions it still believes are its own: frozen now (no tick for
        longer than a freeze: the thread has not run yet since the process did), or woken less than ``suspect_s``
        ago with no assignment since."""
        if now - self.last_tick > self.threshold_s:
            return True
        return self.woke_at is not None and now - self.woke_at < self.suspect_s

    def frozen_since(self, since: float, now: float) -> bool:
        """Whether a freeze ended (or is under way) after ``since``: a decision begun at ``since`` must not write,
        whatever the group assigned since (its partitions may be another's)."""
        if now - self.last_tick > self.threshold_s:
            return True
        return self.last_wake is not None and self.last_wake >= since


class FreezeWatch:
    """``FreezeRule`` fed by a daemon thread's ticks (``start``); read from any thread."""

    def __init__(self, threshold_s: float, suspect_s: float, tick_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, on_freeze: Callable[[float], None] | None = None):
        self.clock, self.tick_s, self.on_freeze = clock, tick_s, on_freeze
        self.rule = FreezeRule(threshold_s=threshold_s, suspect_s=suspect_s, last_tick=clock())
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            with self._lock:
                self.rule.last_tick = self.clock()
            self._thread = threading.Thread(target=self._run, name="freeze-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            with self._lock:
                gap = self.rule.tick(self.clock())
            if gap is not None and self.on_freeze is not None:
                self.on_freeze(gap)

    def assigned(self) -> None:
        with self._lock:
            self.rule.assigned()

    def suspect(self) -> bool:
        if self._thread is None:  # not watching (an app never started): nothing to say
            return False
        with self._lock:
            return self.rule.suspect(self.clock())

    def frozen_since(self, since: float) -> bool:
        if self._thread is None:
            return False
        with self._lock:
            return self.rule.frozen_since(since, self.clock())
