"""The freeze rule (streams/freeze.py): a process woken from a freeze longer than its heartbeats decides nothing until
its group assigns it again or the suspicion expires; a decision begun before a freeze writes nothing after it."""
import time

import pytest

from streams.freeze import FreezeRule, FreezeWatch

THRESHOLD, SUSPECT = 1.0, 12.0

# (ticks at these times, then: assigned?, asked at, suspect?, frozen since 0.5?)
CASES = [
    ("ticking normally", [0.1, 0.2, 0.3], False, 0.35, False, False),
    ("a tick late by less than a freeze", [0.1, 0.9], False, 1.0, False, False),
    ("no tick for longer than a freeze: frozen now", [0.1], False, 1.5, True, True),
    ("woken from a 5.9 s freeze", [0.1, 6.0], False, 6.1, True, True),
    ("woken, still suspect just before the window ends", [0.1, 6.0, 6.1], False, 17.9, True, True),
    ("woken, suspicion over after the window", [0.1, 6.0] + [6.0 + k * 0.1 for k in range(1, 125)], False, 18.45,
     False, True),
    ("woken, then assigned again by the group (a decision begun before still may not write)", [0.1, 6.0, 6.1],
     True, 6.15, False, True),
    ("a freeze that ended before the decision began", [0.1, 0.2], False, 0.25, False, False),
]


@pytest.mark.parametrize("what,ticks,assigned,at,suspect,frozen_since_half", CASES, ids=[c[0] for c in CASES])
def test_freeze_rule(what, ticks, assigned, at, suspect, frozen_since_half):  # noqa: ARG001 - the id says it
    rule = FreezeRule(threshold_s=THRESHOLD, suspect_s=SUSPECT, last_tick=0.0)
    for t in ticks:
        rule.tick(t)
    if assigned:
        rule.assigned()
    assert rule.suspect(at) is suspect
    assert rule.frozen_since(0.5, at) is frozen_since_half


def test_a_decision_begun_after_the_wake_may_write():
    rule = FreezeRule(threshold_s=THRESHOLD, suspect_s=SUSPECT, last_tick=0.0)
    assert rule.tick(6.0) == pytest.approx(6.0) and rule.freezes == 1
    assert rule.frozen_since(5.0, 6.05) and not rule.frozen_since(6.01, 6.05)


def test_the_watch_thread_sees_a_freeze_of_its_clock():
    """The thread part, on a clock that jumps as a frozen process's monotonic clock does when it runs again."""
    offset = [0.0]
    seen: list[float] = []
    watch = FreezeWatch(threshold_s=THRESHOLD, suspect_s=SUSPECT, tick_s=0.01,
                        clock=lambda: time.monotonic() + offset[0], on_freeze=seen.append)
    assert not watch.suspect()  # not started: says nothing
    watch.start()
    deadline = time.monotonic() + 5
    while watch.rule.last_tick < watch.clock() - 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = watch.clock()
    offset[0] += 5.0  # the process "was stopped" 5 s
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[0] >= 5.0
    assert watch.suspect() and watch.frozen_since(t0)
    watch.assigned()
    assert not watch.suspect() and watch.frozen_since(t0) and not watch.frozen_since(watch.clock())
