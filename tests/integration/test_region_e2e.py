"""The whole core loop through the CLI, as a user drives it: `ropewalk up --machines N` starts the broker,
Redis and the control plane (Resource Broker, allocator, scheduler shard, simulated agents, health check);
an entitlement and a job are created through the API; its tasks run spread over MSBs; a machine fails and its tasks
move; the forged commands of issue 12 fail; `ropewalk down` leaves no process behind."""
import json
import time
from pathlib import Path

import pytest
import redis
from confluent_kafka import KafkaException

from infra.config import Config
from infra.process import pid_alive
from regioncli import RegionCli
from streams.clients import DeliveryError, EventProducer
from streams.events import new_event
from streams.serde import SchemaRegistry


@pytest.mark.timeout(240)
def test_up_submit_fail_move_down(tmp_path):
    cli = RegionCli(tmp_path / "run")
    status, wait_for = cli.status, cli.wait_for

    up = cli("up", "--machines", "40", "--json")
    try:
        assert up.returncode == 0, up.stderr
        doc = json.loads(up.stdout)
        pids = [s["pid"] for s in doc["control_plane"].values()]
        assert len(pids) == 12  # resourcebroker, allocator-0, scheduler-0, agents, agent-local, health, api,
        #                         rebalancer, sidekick, jobcontrol, srm, loans
        assert doc["ready"] and doc["machines_indexed"] == 41  # up returns once the whole region is indexed
        # the demo job runs as a real OS process under the process agent, and says so in its log
        assert doc["demo"]["running"], doc["demo"]
        demo = status("demo.hello")
        assert [t["machine"] for t in demo["tasks"]] == ["local-msb1-r01-m001"]
        wait_for(lambda: Path(doc["demo"]["logs"]).exists() and "hello from Ropewalk" in Path(doc["demo"]["logs"]).read_text(),
                 "the demo task's output")
        assert cli("entitlement", "create", "e1", "--quota", "6").returncode == 0
        spec = tmp_path / "web.yaml"
        spec.write_text("name: web\nentitlement: e1\ntasks: 6\ncommand: [sleep, '3600']\n"
                        "resources: {cpu_millicores: 1000, memory_mib: 1024}\nspread: msb\n")
        time.sleep(1)
        submitted = cli("job", "submit", str(spec), "--json")  # through the API: the scheduler's verdict
        assert submitted.returncode == 0, submitted.stderr
        assert {k: json.loads(submitted.stdout)[k] for k in ("job", "verdict")} == {"job": "e1.web",
                                                                                   "verdict": "accepted"}
        forged_commands_fail(cli, tmp_path, "demo.hello")

        running = lambda: cli.running("e1.web", 6)
        view = wait_for(running, "6 RUNNING tasks")
        msbs = {(t["dc"], t["msb"]) for t in view["tasks"]}
        assert len(msbs) >= 3, f"tasks not spread over MSBs: {msbs}"

        victim = view["tasks"][0]["machine"]
        moved = [t["id"] for t in view["tasks"] if t["machine"] == victim]
        assert cli("machine", "fail", victim).returncode == 0

        def replaced():
            v = running()
            return v if v and all(t["machine"] != victim for t in v["tasks"]) else None
        after = wait_for(replaced, "the failed machine's tasks running elsewhere")
        assert {t["id"] for t in after["tasks"]} == {t["id"] for t in view["tasks"]}  # none lost, none added
        assert all(t["machine"] == u["machine"] for t, u in zip(view["tasks"], after["tasks"]) if t["id"] not in moved)
    finally:
        down = cli("down")
    assert down.returncode == 0, down.stderr
    assert not any(pid_alive(p) for p in pids)
    assert not list((tmp_path / "run").glob("*.pid"))


def forged_commands_fail(cli, tmp_path, victim_job):
    """The attacks of issue 12 against a running region: each fails, and the victim's task keeps running."""
    cfg, registry = Config.from_env(cli.env), SchemaRegistry.from_dir()
    machine = "local-msb1-r01-m001"
    # Reaching the broker without credentials: `produce intents JobStopped` of another entitlement's job fails.
    stranger = cli.env | {"ROPEWALK_SECRETS_DIR": str(tmp_path / "no-secrets")}
    out = cli.run_with(stranger, "produce", "intents", "JobStopped", "-", "--entitlement", "demo",
                       input_=json.dumps({"job_id": victim_job, "reason": "x"}))
    assert out.returncode == 1 and "cannot reach Kafka" in out.stderr, out.stderr
    # Through the API, a user of e1 can do nothing to the demo entitlement's job.
    token = cli.ok("user", "add", "mallory", "--role", "e1=owner").strip()
    out = cli.run_with(cli.env | {"ROPEWALK_TOKEN": token}, "job", "stop", victim_job)
    assert out.returncode == 1 and "mallory has no role on entitlement 'demo'" in out.stderr, out.stderr

    def forge(principal, *events):
        p = EventProducer(cfg.as_principal(principal), registry, "forger", **{"message.timeout.ms": 10000})
        for ev in events:
            p.send(ev)
        p.flush(20)

    def task_command(command, task, argv=()):
        return new_event("TaskCommanded", {"task_id": task, "job_id": task.split("/")[0], "machine_id": machine,
                                           "command": command, "argv": list(argv), "env": {}, "spec_version": 1,
                                           "reason": ""}, entitlement=task.split(".")[0], entity_id=task,
                         producer="scheduler")
    # A STOP of the victim's task "from the scheduler", written by a principal that may not write tasks: refused.
    with pytest.raises((DeliveryError, KafkaException), match="Topic authorization failed"):
        forge("api", task_command("STOP", f"{victim_job}/0"))
    # A START for a job and an allocation that do not exist, written with the agents' credentials (the one
    # principal besides the scheduler allowed on tasks): it bears no scheduler's signature (issue 27), so the process
    # agent refuses it and runs nothing.
    forge("agent", task_command("START", "e9.ghost/0", ["sh", "-c", "id > pwned.txt"]))
    refusal = cli.wait_for(lambda: [e for e in cli.replay() if e["type"] == "TaskCommandRefused"],
                           "the agent's TaskCommandRefused")
    assert [(e["payload"]["task_id"], e["payload"]["reason"]) for e in refusal] == [("e9.ghost/0", "unsigned")]
    assert not list(cli.run_dir.glob("agents/*/pwned.txt"))
    # Redis: nobody without a user, not even FLUSHALL; the index is intact.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(cfg.redis_url).flushall()
    assert cfg.redis_client().dbsize() > 0
    assert cli.running(victim_job, 1)  # the victim's task runs on
