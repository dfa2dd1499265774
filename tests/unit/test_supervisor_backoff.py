"""The supervisor's restart rule (infra/supervisor.py ``Backoff``), as a table: the delay before a program that
exited is started again, given the delay before its last start and how long it ran."""
import pytest

from infra.supervisor import Backoff, describe_exit, exit_text

B = Backoff(initial_s=0.5, factor=2.0, max_s=30.0, reset_after_s=30.0)

CASES = [
    # (previous delay, uptime s, delay)
    (None, 0.1, 0.5),  # the first exit: the initial delay, however short the run
    (None, 3600.0, 0.5),
    (0.5, 0.1, 1.0),  # died again soon: doubled
    (1.0, 5.0, 2.0),
    (16.0, 1.0, 30.0),  # capped
    (30.0, 1.0, 30.0),  # stays at the cap: never gives up
    (30.0, 30.0, 0.5),  # ran long enough since its last start: starts over
    (8.0, 29.9, 16.0),
    (0.1, 0.1, 0.5),  # never below the initial delay
]


@pytest.mark.parametrize("previous, uptime, expected", CASES)
def test_backoff(previous, uptime, expected):
    assert B.delay(previous, uptime) == expected


def test_a_crash_loop_backs_off_to_the_cap_and_stays():
    delays, previous = [], None
    for _ in range(12):
        previous = B.delay(previous, 0.2)
        delays.append(previous)
    assert delays[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0] and set(delays[6:]) == {30.0}


@pytest.mark.parametrize("returncode, doc, text", [
    (-9, {"signal": "SIGKILL"}, "killed by SIGKILL after 1.5 s"),  # Popen.returncode: killed by signal 9
    (3, {"code": 3}, "exit code 3 after 1.5 s"),
    (0, {"code": 0}, "exit code 0 after 1.5 s"),
])
def test_exits_are_described(returncode, doc, text):
    assert describe_exit(returncode) == doc
    assert exit_text({**doc, "uptime_s": 1.5}) == text
