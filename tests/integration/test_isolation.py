"""Tasks isolated from one another and from the region, tried as an attacker would (issue 27, items 3 and 6).

* Two jobs' tasks on one real process agent, each a shell script that, once told where the other one is (its
  directory, its pid), tries to read its files (one of them 0644), list its directory, write into it (and into a
  0777 directory inside it), and signal it (TERM, KILL); with and without the bubblewrap sandbox. Every try is
  refused, both tasks keep running with their files as they were, and each runs as a uid of its own; in the sandbox
  a task sees no process but its own (PID namespace), and the run directory is empty to it.
* A task of a real region (`ropewalk up`) tries to open every file under the run directory: the broker's
  segments, Redis's append-only file, the secrets, the agents' state and logs, the workers' logs, the metrics port
  files, the history snapshots (whatever a region has written by then); it can open its own files alone. Run
  without the sandbox, so what is tried is the files' modes (infra/private.py), not the sandbox hiding them.

These need root (an agent hands out uids only as root): CI runs as root. There, the sandbox is demanded: a machine
without bubblewrap, or where it cannot make its namespaces, fails the sandboxed case (`bash infra/bootstrap.sh
--for-tests` installs it). An agent that is not root runs its tasks as itself, unsandboxed, and says so: what it
decides on every kind of machine is tests/unit/test_isolation_parts.py's.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from processors.agent import isolation as iso
from processors.agent.process import STATE_FILE, task_dir
from regioncli import RegionCli
from test_agent_process import Agents, Reader, agent_state, allocated, command, reports, send, wait_for

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="tasks get uids of their own only from an agent run as root")

ATTACK = r"""
me=$1
echo "secret of $me" > mine.txt && chmod 644 mine.txt
mkdir -p open && chmod 777 open
echo "uid $(id -u) gid $(id -g) groups $(id -G)"
while [ ! -s go ]; do sleep 0.05; done
read other_dir other_pid run_dir work_dir < go
if cat "$other_dir/mine.txt" >/dev/null 2>&1; then echo "read: got in"; else echo "read: refused"; fi
if ls "$other_dir" >/dev/null 2>&1; then echo "list: got in"; else echo "list: refused"; fi
if (echo x > "$other_dir/intruder") 2>/dev/null; then echo "write: got in"; else echo "write: refused"; fi
if (echo x > "$other_dir/open/intruder") 2>/dev/null; then echo "write-open: got in"; else echo "write-open: refused"; fi
if kill -TERM "$other_pid" 2>/dev/null; then echo "term: got in"; else echo "term: refused"; fi
if kill -KILL "$other_pid" 2>/dev/null; then echo "kill: got in"; else echo "kill: refused"; fi
if ls "$run_dir" >/dev/null 2>&1; then echo "run-dir: got in"; else echo "run-dir: refused"; fi
if ls "$work_dir" >/dev/null 2>&1; then echo "work-dir: got in"; else echo "work-dir: refused"; fi
if cat "$work_dir/agent-state.json" >/dev/null 2>&1; then echo "state: got in"; else echo "state: refused"; fi
echo "uids seen: $(cat /proc/[0-9]*/status 2>/dev/null | awk '/^Uid:/ {print $2}' | sort -un | tr '\n' ' ')"
echo "$me: over"
exec sleep 600
"""
TRIES = ("read", "list", "write", "write-open", "term", "kill", "run-dir", "work-dir", "state")


def passable_dir() -> Path:
    """A directory every user may pass through (0711) down from /: a task reaches another's directory by its path
    and meets that directory's own mode, not a 0700 pytest directory above it."""
    d = Path(tempfile.mkdtemp(prefix="ropewalk-isolation-", dir="/tmp"))
    os.chmod(d, 0o711)
    return d


def task_output(log: Path) -> list[str]:
    """What a task wrote to its log: its lines, without the agent's ``--- ... spawn [argv]`` lines (whose argv holds
    the script's text)."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if not line.startswith("--- ")]


def held_by(leases: Path, uid: int) -> str | None:
    """The owner (an agent's state file) named in ``uid``'s lease, or None when no lease is there."""
    try:
        return str(json.loads((leases / str(uid)).read_text()).get("owner"))
    except FileNotFoundError:
        return None
    except ValueError:
        return "(a lease being written)"


def task_log(work: Path, task: str) -> Path:
    return work / "logs" / (task.replace("/", "_") + ".log")


@ROOT_ONLY
@pytest.mark.parametrize("sandbox", [iso.BWRAP, iso.NONE])
def test_two_jobs_tasks_cannot_read_write_or_signal_each_other(cfg, registry, tmp_path, sandbox):
    if sandbox == iso.BWRAP:  # demanded here: a machine where it does not run fails, saying why
        bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
        if bwrap is None or setpriv is None:
            pytest.fail("bubblewrap or setpriv is missing: `bash infra/bootstrap.sh --for-tests` installs it (as root)")
        why = iso.probe_sandbox(bwrap, setpriv, tmp_path / "probe")
        assert why is None, f"the sandbox does not run on this machine: {why}"
    top = passable_dir()
    agents = Agents(tmp_path)
    machine, work = "m-iso", top / "m-iso"
    tasks = Reader(cfg, registry, "tasks")
    a, b = "j1/0", "j2/0"
    try:
        agents.start(cfg, machine, work, "--task-sandbox", sandbox)
        send(cfg, registry, allocated("j1", {a: machine}), allocated("j2", {b: machine}),
             command(a, "START", machine, ["sh", "-c", ATTACK, "attack", "A"], job="j1"),
             command(b, "START", machine, ["sh", "-c", ATTACK, "attack", "B"], job="j2"))
        tasks.until(lambda evs: all(("RUNNING", None) in reports(evs, t) for t in (a, b)), 60, "both RUNNING")
        state = agent_state(work)
        assert state["sandbox"] == sandbox
        uid = {t: state["uids"][t] for t in (a, b)}
        assert uid[a] != uid[b] and all(u in iso.UidRange.parse(iso.DEFAULT_UIDS) for u in uid.values()), uid
        dirs = {t: task_dir(work, t) for t in (a, b)}
        wait_for(lambda: all((dirs[t] / "mine.txt").exists() and (dirs[t] / "open").is_dir() for t in (a, b)), 30,
                 "both tasks' files")
        for t in (a, b):
            st = dirs[t].stat()
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid[t], uid[t], 0o700), (t, st)
            assert iso.processes_of(uid[t]), f"no process runs as {t}'s uid {uid[t]}"
        victims = {t: min(iso.processes_of(uid[t])) for t in (a, b)}  # its script's shell (the first of its uid)
        for t, other in ((a, b), (b, a)):
            go = dirs[t] / "go"
            tmp = dirs[t] / ".go"
            tmp.write_text(f"{dirs[other]} {victims[other]} {cfg.run_dir} {work}\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, go)
        wait_for(lambda: all(f"{name}: over" in task_output(task_log(work, t)) for t, name in ((a, "A"), (b, "B"))), 30,
                 "both attacks done")
        for t, other in ((a, b), (b, a)):
            out = task_output(task_log(work, t))
            assert f"uid {uid[t]} gid {uid[t]} groups {uid[t]}" in out, out
            for what in TRIES:
                assert f"{what}: refused" in out, f"{t} tried {what} on {other}: {out}"
            seen = {int(x) for line in out if line.startswith("uids seen: ") for x in line.split()[2:]}
            assert uid[t] in seen, out
            assert uid[other] not in seen if sandbox == iso.BWRAP else uid[other] in seen, (sandbox, seen)
            if sandbox == iso.BWRAP:
                assert seen <= {0, uid[t]}, seen  # its own processes, and the sandbox's own (root's) alone
        for t in (a, b):
            assert (dirs[t] / "mine.txt").read_text() == f"secret of {'A' if t == a else 'B'}\n"
            assert not (dirs[t] / "intruder").exists() and not (dirs[t] / "open" / "intruder").exists()
            assert victims[t] in iso.processes_of(uid[t]), f"{t}'s process {victims[t]} was killed"
        assert not any(s in ("STOPPED", "FAILED") for t in (a, b) for s, _ in reports(tasks.events, t))

        # -- stopped, each uid is handed back: no process left with it, its directory root's, its lease gone ------
        send(cfg, registry, command(a, "STOP", machine, job="j1"), command(b, "STOP", machine, job="j2"))
        tasks.until(lambda evs: all(any(s == "STOPPED" for s, _ in reports(evs, t)) for t in (a, b)), 30,
                    "both STOPPED")
        wait_for(lambda: not agent_state(work)["uids"], 10, "the uids handed back")
        leases = Path(os.environ.get(iso.LEASES_ENV) or iso.DEFAULT_LEASES)
        for t in (a, b):
            assert dirs[t].stat().st_uid == 0
            # the lease directory is the machine's, shared by every agent on it: another region's agent (a test
            # beside this one) may lease the uid handed back the moment it is free; this agent's lease is gone
            running = iso.processes_of(uid[t])  # before the lease: an agent leases a uid before it runs anything
            holder = held_by(leases, uid[t])
            assert holder != str(work / STATE_FILE), (t, uid[t])
            assert not running or holder is not None, (t, uid[t], running)
    finally:
        tasks.close()
        agents.cleanup()
        shutil.rmtree(top, ignore_errors=True)


PROBE = r"""
while [ ! -s paths ]; do sleep 0.1; done
mine=$(pwd)
n=0
while IFS= read -r p; do
  if head -c 1 "$p" >/dev/null 2>&1; then echo "OPENED $p"; else n=$((n + 1)); fi
done < paths
echo "REFUSED $n"
echo "probe: over"
exec sleep 3600
"""


@ROOT_ONLY
@pytest.mark.timeout(300)
def test_a_task_reads_no_file_of_the_run_directory_but_its_own(tmp_path):
    top = passable_dir()
    run = top / "run"
    region = RegionCli(run, ROPEWALK_TASK_SANDBOX=iso.NONE)  # the files' modes are what is tried, not the sandbox
    try:
        up = region.json("up", "--machines", "2")
        assert up and up["ready"] and up["demo"]["running"], up
        region.ok("machine", "list", "--at", "now")  # the history's snapshots are written under the run directory
        region.ok("job", "stop", "demo.hello")  # the local machine's room for the probe (demo holds it)
        region.wait_for(lambda: (region.status("demo.hello") or {}).get("deleted"), "demo.hello stopped and gone",
                        120)  # (its status says so since the operator's view, #30)
        spec = tmp_path / "probe.json"
        spec.write_text(json.dumps({"name": "eye", "entitlement": "demo", "tasks": 1, "command": ["sh", "-c", PROBE],
                                    "resources": {"cpu_millicores": 100, "memory_mib": 64}}))
        region.ok("job", "submit", str(spec))
        region.wait_for(lambda: region.running("demo.eye", 1), "the probe RUNNING", 120)
        work = run / "agents" / "local-msb1-r01-m001"
        mine = task_dir(work, "demo.eye/0")
        files = sorted(str(p) for p in run.rglob("*") if p.is_file() and not p.is_symlink())
        own = [f for f in files if Path(f).is_relative_to(mine)]
        others = [f for f in files if f not in own]
        assert any("/kafka/" in f and f.endswith(".log") for f in others), "no broker segment to try"
        assert any("/redis/" in f for f in others) and any("/secrets/" in f for f in others)
        assert any(f.endswith("agent-state.json") for f in others) and str(run / "api.log") in others
        assert any("/metrics/" in f and f.endswith(".port") for f in others)
        paths = mine / ".paths"
        paths.write_text("\n".join(others + [str(mine / "paths")]) + "\n")
        os.chmod(paths, 0o644)
        os.replace(paths, mine / "paths")
        log = work / "logs" / "demo.eye_0.log"
        region.wait_for(lambda: "probe: over" in task_output(log), "the probe done", 120)
        out = task_output(log)
        opened = [line[len("OPENED "):] for line in out if line.startswith("OPENED ")]
        chain = {str(p): f"{p.stat().st_mode & 0o7777:04o} {p.stat().st_uid}" for p in [mine / "paths", mine, *mine.parents]}
        assert opened == [str(mine / "paths")], f"a task opened {opened[:20]} ({len(opened)} files); {chain}; {out[-5:]}"
        assert f"REFUSED {len(others)}" in out, out[-20:]
        uid = json.loads((work / "agent-state.json").read_text())["uids"]["demo.eye/0"]
        assert uid in iso.UidRange.parse(iso.DEFAULT_UIDS)
    finally:
        region("down", timeout_s=120)
        shutil.rmtree(top, ignore_errors=True)
