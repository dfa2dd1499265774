"""Big jobs on a real region (issue #10 item 5): served or refused at the door, and never a stop for the others.

Through the CLI, as a user drives it (``ropewalk up --machines 40``: broker, Redis, Resource Broker, allocator,
one scheduler shard, simulated agents, health):

* ``job submit`` of a job over the limit (``ROPEWALK_MAX_TASKS_PER_JOB``, default 25,000) exits non-zero with one
  line naming the field and the limit, as does ``ropewalk produce``; the same job written to the log by another
  writer is rejected by the scheduler with reason ``too_many_tasks``, and nothing else happens;
* a job of 20,000 tasks on this small region: the scheduler asks for all of them, the allocator places what its
  entitlement's quota allows and rejects the rest with a reason; the job shows every one of its 20,000 tasks
  (``job status``, assembled from its parts on state.tasks), the placed ones RUNNING, the others PENDING with the
  reason; meanwhile another entitlement's small job is submitted after it and runs; the scheduler stays up.

Before: a 20,000-task job made an 8.7 MB changelog record and the only scheduler crash-looped
(``MessageSizeTooLargeError``), taking every other entitlement with it.
"""
import json
import time

import pytest

from infra.config import Config
from infra.process import pid_alive
from regioncli import RegionCli
from streams.clients import EventProducer
from streams.events import new_event
from streams.serde import SchemaRegistry

BIG = 20_000


def spec(path, name, ent, tasks, cpu):
    path.write_text(f"name: {name}\nentitlement: {ent}\ntasks: {tasks}\ncommand: [sleep, '3600']\n"
                    f"resources: {{cpu_millicores: {cpu}, memory_mib: 1024}}\nspread: msb\n")
    return str(path)


@pytest.mark.timeout(420)
def test_a_20000_task_job_is_served_as_far_as_it_fits_while_another_entitlement_runs(tmp_path):
    cli = RegionCli(tmp_path / "run")
    up = cli("up", "--machines", "40", "--json")
    try:
        assert up.returncode == 0, up.stderr
        scheduler = json.loads(up.stdout)["control_plane"]["scheduler-0"]["pid"]
        cli.ok("entitlement", "create", "e1", "--quota", "4")
        cli.ok("entitlement", "create", "e2", "--quota", "3")
        time.sleep(1)

        # over the limit: refused at the door, one line naming the field and the limit
        refused = cli("job", "submit", spec(tmp_path / "huge.yaml", "huge", "e1", 30_000, 100))
        assert refused.returncode != 0 and refused.stdout == ""
        assert refused.stderr.strip().splitlines() == [
            f"ropewalk: {tmp_path / 'huge.yaml'}: tasks: at most 25,000 tasks per job (ROPEWALK_MAX_TASKS_PER_JOB), "
            "got 30,000"]
        # ... and by the scheduler, should such a job reach the log some other way (`produce` refuses it too: a
        # writer of its own)
        raw = {"job_id": "e1.raw", "name": "raw", "spec_version": 1, "tasks": 30_000, "command": ["sleep", "1"],
               "resources": {"cpu_millicores": 100, "memory_mib": 64}, "requirements": {}, "spread": "msb",
               "max_unavailable": 1, "env": {}}
        assert "tasks: at most 25,000" in cli("produce", "intents", "JobSubmitted", "-", "--entitlement", "e1",
                                              input_=json.dumps(raw)).stderr
        writer = EventProducer(Config.from_env(cli.env), SchemaRegistry.from_dir(), "another-writer")
        writer.send(new_event("JobSubmitted", raw, entitlement="e1", entity_id="e1.raw", producer="another-writer"))
        writer.flush()

        # a big job on a small region, then another entitlement's small one
        assert cli("job", "submit", spec(tmp_path / "big.yaml", "big", "e1", BIG, 16_000)).stdout.strip() == "e1.big"
        assert cli("job", "submit", spec(tmp_path / "small.yaml", "small", "e2", 3, 1000)).stdout.strip() == "e2.small"

        small = cli.wait_for(lambda: cli.running("e2.small", 3), "the other entitlement's job running", 120)
        assert small["state"] == "running"

        def big_settled():
            view = cli.status("e1.big")
            if not view or len(view["tasks"]) != BIG or not view["last_reason"]:
                return None
            placed = [t for t in view["tasks"] if t["machine"]]
            if not placed or any(t["state"] != "RUNNING" for t in placed):
                return None
            return view
        big = cli.wait_for(big_settled, "the big job placed as far as it fits, the rest with a reason", 180)
        placed = [t for t in big["tasks"] if t["machine"]]
        waiting = [t for t in big["tasks"] if not t["machine"]]
        assert 0 < len(placed) <= 4 * 2 and len(waiting) == BIG - len(placed)  # 4 machines of e1, <= 2 tasks each
        assert {t["state"] for t in waiting} == {"PENDING"} and all(t["reason"] for t in waiting)
        assert big["state"] == "pending" and big["desired_tasks"] == BIG
        assert [t["id"] for t in big["tasks"]] == [f"e1.big/{i}" for i in range(BIG)]  # whole, in order

        raw_view = cli.status("e1.raw")
        assert raw_view["state"] == "rejected" and raw_view["tasks"] == []
        assert raw_view["last_reason"] == ("too_many_tasks: tasks: at most 25,000 tasks per job "
                                           "(ROPEWALK_MAX_TASKS_PER_JOB), got 30,000")

        assert pid_alive(scheduler), "the scheduler shard must not have stopped"
        assert cli.running("e2.small", 3), "the small job still runs"
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
