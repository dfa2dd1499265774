"""The region's supervisor (infra/supervisor.py) on real processes: a program that dies is started again after a
backoff and the restart recorded; one that keeps dying backs off further; `stop` leaves nothing behind, also the
programs of a supervisor that was itself killed; a new supervisor never runs a program twice."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from infra import supervisor
from infra.config import PROJECT_ROOT
from infra.process import STOP_WITH_VAR, ManagedProcess, die_with_parent, pid_alive
from regioncli import wait_for


PROGRAMS = [supervisor.Program("sleeper", ("sleep", "600")),
            supervisor.Program("crasher", ("sh", "-c", "exit 3")),
            supervisor.Program("svc", ("sleep", "600"), service=True)]


@pytest.fixture
def run_dir(tmp_path):
    yield tmp_path
    supervisor.stop(tmp_path)


def state(run_dir, name):
    return supervisor.programs_state(run_dir)[name]


def test_dead_programs_are_started_again_with_backoff_and_recorded(run_dir):
    st = supervisor.ensure(run_dir, PROGRAMS)
    assert supervisor.expected(run_dir) == ["svc", "sleeper", "crasher"]  # services first
    first = st["sleeper"]["pid"]
    assert pid_alive(first) and (run_dir / "sleeper.pid").read_text() == str(first)
    os.kill(first, signal.SIGKILL)
    again = wait_for(lambda: (s := state(run_dir, "sleeper"))["running"] and s["pid"] != first and s, "a new sleeper")
    assert again["restarts"] == 1 and again["last_exit"]["signal"] == "SIGKILL" and not pid_alive(first)

    # A program that keeps dying is retried, each time after a longer delay (0.5, 1, 2 s, ...).
    wait_for(lambda: state(run_dir, "crasher")["restarts"] >= 3, "three restarts of the crasher", 10)
    records = [json.loads(line) for line in (run_dir / supervisor.RESTARTS_FILE).read_text().splitlines()]
    crashes = [r for r in records if r["program"] == "crasher"]
    assert [r["code"] for r in crashes[:3]] == [3, 3, 3]
    assert [r["delay_s"] for r in crashes[:3]] == [0.5, 1.0, 2.0]
    assert [r["signal"] for r in records if r["program"] == "sleeper"] == ["SIGKILL"]
    assert "sleeper: pid %d ended (killed by SIGKILL" % first in (run_dir / "supervisor.log").read_text()

    # A second ensure changes nothing that runs.
    supervisor.ensure(run_dir, PROGRAMS[:1])
    assert state(run_dir, "sleeper")["pid"] == again["pid"]

    pids = [s["pid"] for s in supervisor.programs_state(run_dir).values() if s["pid"]]
    out = supervisor.stop(run_dir)
    assert out["sleeper"]["stopped"] and out["svc"]["stopped"]
    assert not any(pid_alive(p) for p in pids) and not list(run_dir.glob("*.pid"))
    assert supervisor.programs_state(run_dir) == {}  # nothing expected any more
    assert supervisor.stop(run_dir) == {}  # idempotent


def test_the_programs_of_a_killed_supervisor_are_stopped_and_never_doubled(run_dir):
    st = supervisor.ensure(run_dir, PROGRAMS[:1])
    child = st["sleeper"]["pid"]
    sup = supervisor.process(run_dir).pid()
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: not pid_alive(sup), "the supervisor gone")
    assert pid_alive(child)  # its own session: the program outlived it
    orphaned = state(run_dir, "sleeper")
    assert orphaned["running"] and orphaned["pid"] == child and not orphaned["supervised"]  # running, unsupervised

    # A new supervisor stops the orphan before it starts the program: one sleeper, never two.
    st = supervisor.ensure(run_dir, PROGRAMS[:1])
    assert not pid_alive(child) and st["sleeper"]["pid"] != child and pid_alive(st["sleeper"]["pid"])

    # Killed again: `stop` finds the orphan by its pid file (pid and start time) and stops it.
    new_child = st["sleeper"]["pid"]
    sup = supervisor.process(run_dir).pid()
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: not pid_alive(sup), "the supervisor gone")  # its pid file stays behind (CI once saw that)
    out = supervisor.stop(run_dir)
    assert out["sleeper"]["stopped"] and not pid_alive(new_child)
    assert not list(run_dir.glob("*.pid"))


def test_after_a_power_loss_the_workers_wait_until_up_lists_them_again(run_dir):
    """A cold start: the supervisor and every program SIGKILLed at once (the programs file still lists them: only
    `stop` empties it). The supervisor `ensure` starts again for the services runs them alone; the workers are held
    (shown HELD, not started, however often the supervisor is told to reload) until an ``ensure`` names them."""
    st = supervisor.ensure(run_dir, PROGRAMS[:1] + PROGRAMS[2:])
    pids = [supervisor.process(run_dir).pid(), st["sleeper"]["pid"], st["svc"]["pid"]]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(pid_alive(p) for p in pids), "the supervisor and its programs gone")

    back = supervisor.ensure(run_dir, PROGRAMS[2:])  # the services (the broker's nodes, redis-server) first
    assert back["svc"]["running"] and back["sleeper"]["state"] == supervisor.HELD and not back["sleeper"]["running"]
    assert supervisor.expected(run_dir) == ["svc", "sleeper"]  # still listed: `up` keeps the region's counts
    supervisor.ensure(run_dir, PROGRAMS[2:])  # a second service's ensure (a reload): still held
    assert state(run_dir, "sleeper")["state"] == supervisor.HELD
    assert "held until `up` lists them again" in (run_dir / "supervisor.log").read_text()

    again = supervisor.ensure(run_dir, PROGRAMS[:1])  # `up` starts the control plane
    assert again["sleeper"]["running"] and again["sleeper"]["restarts"] == 0
    assert again["svc"]["pid"] == back["svc"]["pid"]


def test_a_retired_program_is_stopped_for_good_and_can_come_back(run_dir):
    """`up` with fewer shards: ``retire`` takes programs out of the programs file; the supervisor stops them (TERM, then
    KILL after its timeout: here a program that ignores TERM) and does not start them again; one waiting for its
    restart goes at once; a program listed again later starts anew."""
    programs = [supervisor.Program("keeper", ("sleep", "600")),
                supervisor.Program("stubborn", ("sh", "-c", "trap '' TERM; sleep 600 & wait")),
                supervisor.Program("crasher", ("sh", "-c", "exit 3"))]
    st = supervisor.ensure(run_dir, programs)
    wait_for(lambda: state(run_dir, "crasher")["restarts"] >= 1, "the crasher waiting for its restart")
    keeper, stubborn = st["keeper"]["pid"], st["stubborn"]["pid"]
    out = supervisor.retire(run_dir, ["stubborn", "crasher"], timeout_s=supervisor.STOP_TIMEOUT_S + 10)
    assert out == {"stubborn": True, "crasher": True}
    assert not pid_alive(stubborn) and pid_alive(keeper)
    assert supervisor.expected(run_dir) == ["keeper"] and set(supervisor.programs_state(run_dir)) == {"keeper"}
    wait_for(lambda: set((supervisor.read_state(run_dir) or {}).get("programs", {})) == {"keeper"},
             "the supervisor's state without them")
    assert not (run_dir / "stubborn.pid").exists()
    log = (run_dir / "supervisor.log").read_text()
    assert "stubborn: retired" in log and "stubborn: pid %d did not stop" % stubborn in log  # TERM ignored: KILL
    assert "stubborn: started" not in log.split("stubborn: retired (no longer")[1]  # not restarted
    back = supervisor.ensure(run_dir, programs[1:2])
    assert back["stubborn"]["pid"] not in (None, stubborn) and back["stubborn"]["restarts"] == 0
    assert state(run_dir, "keeper")["pid"] == keeper
    os.killpg(back["stubborn"]["pid"], signal.SIGKILL)  # it ignores TERM: the fixture's stop would wait its timeout
    supervisor.retire(run_dir, ["stubborn"])  # waiting for its restart: goes at once


STARTER = """
import json, sys, time
from pathlib import Path
from infra import supervisor
from infra.process import ManagedProcess, tie_regions_to_this_process

run_dir = Path(sys.argv[1])
if sys.argv[2] == "tied":
    tie_regions_to_this_process()
st = supervisor.ensure(run_dir, [supervisor.Program("sleeper", ("sleep", "600")),
                                 supervisor.Program("svc", ("sleep", "600"), service=True)])
direct = ManagedProcess("direct", ["/bin/sleep", "600"], None, run_dir, ready=lambda: True).start()
print(json.dumps({"supervisor": supervisor.process(run_dir).pid(), "direct": direct["pid"],
                  **{n: s["pid"] for n, s in st.items()}}), flush=True)
time.sleep(600)
"""


def test_a_region_stops_when_the_process_that_started_it_is_killed(tmp_path):
    """A test's or an experiment's region (``ROPEWALK_STOP_WITH``: tied) stops when its starter dies by SIGKILL: the
    supervisor's programs (it notices), the process the starter ran directly (its death signal), the supervisor.
    A user's region (untied, as `ropewalk up` starts it) outlives its starter."""
    env = {k: v for k, v in os.environ.items() if k != STOP_WITH_VAR}
    starters, pids = {}, {}
    for kind in ("tied", "untied"):
        (tmp_path / kind).mkdir()
        starters[kind] = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / kind), kind], env=env,
                                          cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True,
                                          preexec_fn=die_with_parent)
    try:
        for kind, starter in starters.items():
            pids[kind] = json.loads(starter.stdout.readline())
            assert set(pids[kind]) == {"supervisor", "direct", "sleeper", "svc"}
            assert all(map(pid_alive, pids[kind].values()))
            starter.kill()
            starter.wait()
        wait_for(lambda: not any(map(pid_alive, pids["tied"].values())), "no process of the tied region left", 60)
        # The untied region is checked after the tied one went: its supervisor had as long to notice anything.
        assert pid_alive(pids["untied"]["supervisor"]) and pid_alive(pids["untied"]["sleeper"])
        assert "is gone: stopping every program" in (tmp_path / "tied" / "supervisor.log").read_text()
    finally:
        for kind, starter in starters.items():
            starter.kill()
            supervisor.stop(tmp_path / kind)
            ManagedProcess("direct", ["/bin/sleep"], None, tmp_path / kind, ready=lambda: True).stop()
