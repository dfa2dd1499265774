"""What isolating a task costs at its start (issue 27): the process agent's spawn, with and without the sandbox.

    sudo .venv/bin/python bench/task_start.py [--runs 200]

As root (the agent hands out uids only as root). Each mode starts ``--runs`` tasks of ``true`` the way the process
agent does (processors/agent/isolation.py) and waits for each to exit (a start and an exit: the shortest task
there is), one at a time; the time is from ``Popen`` to the exit reaped:

  baseline   ``true`` as root, in its own session, in a directory: the spawn as it was before any isolation
  uid        ``true`` as a uid of its own (``Popen(user=, group=, extra_groups=[])``): the switch alone
  sandbox    ``bwrap ... setpriv ... true`` (``sandbox_argv``: read-only root, the run directory hidden, private
             /tmp, /var/tmp, /dev/shm, /dev, /proc, PID and IPC namespaces), as a uid of its own

and, apart, what the agent does before a task's first spawn: ``lease``, a uid leased (host-wide lease file, a scan
of /proc for uids in use) and handed back, and ``own``, its directory made and given to it. Prints ms per start
(p50, p90, p99, mean) with the machine's conditions. The baseline is measured in the same run, interleaved (a
round of every mode, then the next round), so a busy neighbour weighs on every mode alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from processors.agent import isolation as iso  # noqa: E402

UID = 79990  # at the top of the default range, apart from what a region's agents lease from its bottom


def percentiles(xs: list[float]) -> str:
    s = sorted(xs)
    at = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"p50 {at(0.5):6.2f}  p90 {at(0.9):6.2f}  p99 {at(0.99):6.2f}  mean {statistics.mean(s):6.2f} ms"


def timed(argv: list[str], cwd: Path, **kw) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, env={"PATH": iso.DEFAULT_PATH}, **kw)
    code = p.wait()
    took = (time.perf_counter() - t0) * 1000
    if code != 0:
        raise SystemExit(f"{argv[0]} exited {code}: the mode does not run here")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("as root: the agent gives tasks uids of their own only as root")
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    top = Path(tempfile.mkdtemp(prefix="task-start-"))
    try:
        run_dir = top / "run"
        task = run_dir / "agents" / "m" / "tasks" / "t_0"
        task.mkdir(parents=True)
        os.chown(task, UID, UID)
        sandboxed = iso.sandbox_argv(["true"], task_dir=task, hidden=[run_dir], uid=UID, gid=UID,
                                     bwrap=bwrap or "bwrap", setpriv=setpriv or "setpriv")
        modes = {"baseline": (["true"], {}), "uid": (["true"], {"user": UID, "group": UID, "extra_groups": []})}
        if bwrap and setpriv:
            modes["sandbox"] = (sandboxed, {})
        times: dict[str, list[float]] = {m: [] for m in modes}
        for argv, kw in modes.values():  # warm the page cache
            timed(argv, task, **kw)
        for _ in range(args.runs):
            for name, (argv, kw) in modes.items():
                times[name].append(timed(argv, task, **kw))
        leases = iso.Leases(top / "leases", iso.UidRange(UID, UID + 9), top / "agent-state.json")
        lease, own = [], []
        for i in range(args.runs):
            t0 = time.perf_counter()
            uid = leases.acquire(f"t/{i}")
            t1 = time.perf_counter()
            iso.own(task, uid, leases.uids)
            t2 = time.perf_counter()
            leases.release(uid)
            iso.disown(task)
            lease.append((t1 - t0) * 1000)
            own.append((t2 - t1) * 1000)
        procs = sum(1 for p in os.listdir("/proc") if p.isdigit())
        print(f"task start, {args.runs} runs per mode, interleaved; {platform.node()}, Linux {platform.release()}, "
              f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {procs} processes, "
              f"{subprocess.run([bwrap, '--version'], capture_output=True, text=True).stdout.strip() if bwrap else 'no bwrap'}")
        base = statistics.median(times["baseline"])
        for name, xs in times.items():
            extra = "" if name == "baseline" else f"   (+{statistics.median(xs) - base:.2f} ms on the median)"
            print(f"  {name:9} {percentiles(xs)}{extra}")
        if "sandbox" not in times:
            print("  sandbox   not measured: bubblewrap or setpriv is missing")
        print(f"  {'lease':9} {percentiles(lease)}   (once per task, not per restart)")
        print(f"  {'own':9} {percentiles(own)}")
    finally:
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
