"""The forgeries of issue 27, made on a real region (`ropewalk up`) as an attacker who took over one machine makes
them: with the `agent` principal's Kafka credentials, that machine's own key, and the project's own encoder. Each is
refused, changes nothing in the region, and is in the dead letters with its reason, dead-lettered by the readers the
issue names (the process agent for commands, the scheduler for task reports, the health check for heartbeats, the
Resource Broker, allocator and Sidekick for machine events); `replay` shows every record's proven identity, so
none passes for `health` or `scheduler`.

Before issue 27 (issue 12's region, same attacks): the forged START ran its own argv as the machine's task user, four
forged STOPs or FAILED reports killed a task for good, a forged DOWN moved a healthy machine's tasks, a heartbeat
dated a day ahead kept a machine UP after its agent stopped, a forged registration made a phantom 1,000,000-millicore
machine, a forged host-profile answer showed a profile applied that was not.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from infra import trust
from infra.acls import reader_group
from infra.config import Config
from processors.controlplane import LOCAL_MACHINE_ID, worker_pid
from processors.resourcebroker.region import iter_machines, load_region
from regioncli import RegionCli
from streams import auth
from streams.clients import key_of, producer_conf
from streams.events import new_event
from streams.serde import SchemaRegistry
from streams.topics import TOPIC_OF_EVENT, Topics

LOCAL = LOCAL_MACHINE_ID  # the victim: the process agent's machine, where demo.hello runs as an OS process
TASK, JOB, ENT = "demo.hello/0", "demo.hello", "demo"
DAY_MS = 24 * 3600 * 1000
MACHINE_READERS = {"resourcebroker", "allocator", "sidekick"}  # the readers of machine events the issue names


class Attacker:
    """A compromised machine: the `agent` principal's credentials and its own key (the file the operator gave it)."""

    def __init__(self, region: RegionCli, machine: str, tmp_path):
        self.cfg = Config.from_env(region.env)
        self.registry = SchemaRegistry.from_dir()
        self.machine = machine
        doc = json.loads(trust.write_machine_key(self.cfg.secrets, machine, tmp_path / "stolen.json").read_text())
        self.own = auth.MachineSigner(lambda m: trust.unb64(doc["key"]) if m == machine else None)
        self.topics = Topics(self.cfg.topic_prefix, self.cfg.partitions)
        self.producer = Producer(producer_conf(self.cfg.as_principal("agent"), **{"message.timeout.ms": 15000,
                                                                                    "log_level": 0}))
        self.sent: dict[str, tuple[str, int, int]] = {}  # name -> (topic, partition, offset)

    def record(self, ev):
        return ev.to_record(self.registry.reader(ev.type).version)

    def unsigned(self, ev) -> bytes:
        return self.registry.encode(ev.type, self.record(ev))

    def claiming(self, ev, identity: str, key_id: str = auth.HMAC_KEY_ID) -> bytes:
        """``ev`` claiming to be ``identity``'s, with a proof the attacker cannot make (random bytes)."""
        rec = self.record(ev)
        rec["envelope"]["auth"] = auth.auth_block(identity, key_id)
        return auth.seal(self.registry.encode(ev.type, rec), identity, key_id,
                         lambda m: os.urandom(64 if key_id != auth.HMAC_KEY_ID else 32))

    def as_itself(self, ev) -> bytes:
        """Sealed with the attacker's own machine key (a true proof that the attacker wrote it)."""
        if ev.type == "TaskStatesChanged":  # a proof per report, each under the attacker's key whatever it names
            rec = self.record(ev)
            key = self.own.key_of(self.machine)
            rec["reports"] = [{**r, "proof": auth.item_proof(key, ev.entitlement, r)} for r in rec["reports"]]
            return self.registry.encode(ev.type, rec)
        rec = self.record(ev)
        identity = auth.machine_identity(self.machine)
        rec["envelope"]["auth"] = auth.auth_block(identity, auth.HMAC_KEY_ID)
        key = self.own.key_of(self.machine)
        return auth.seal(self.registry.encode(ev.type, rec), identity, auth.HMAC_KEY_ID, lambda m: auth.mac(key, m))

    def send(self, name: str, ev, value: bytes) -> None:
        logical = TOPIC_OF_EVENT[ev.type]
        got = {}
        self.producer.produce(self.topics.name(logical), key=key_of(logical, ev).encode(), value=value,
                              on_delivery=lambda err, msg: got.update(err=err, at=(msg.topic(), msg.partition(),
                                                                                  msg.offset())))
        self.producer.flush(20)
        assert got.get("err") is None and "at" in got, (name, got)
        self.sent[name] = got["at"]


def ev_(type_, payload, entitlement, entity, producer, ts=None):
    return new_event(type_, payload, entitlement=entitlement, entity_id=entity, producer=producer, timestamp_ms=ts,
                     event_id=str(uuid.uuid4()))


def command(cmd: str, argv=(), spec_version=1):
    return ev_("TasksCommanded", {"job_id": JOB, "argv": list(argv), "env": {}, "part": 0, "parts": 1,
                                  "host_profile": "", "resources": None,
                                  "commands": [{"task_id": TASK, "machine_id": LOCAL, "command": cmd,
                                                "spec_version": spec_version, "reason": "forged"}]},
               ENT, JOB, "scheduler")


def failed_report(machine: str = LOCAL):
    rid = str(uuid.uuid4())
    return ev_("TaskStatesChanged", {"reports": [{
        "report_id": rid, "task_id": TASK, "job_id": JOB, "machine_id": machine, "state": "FAILED",
        "previous_state": "RUNNING", "exit_code": 1, "spec_version": 1, "reason": "restart_limit", "cause_id": None,
        "proof": None}]}, ENT, TASK, f"agent/{machine}")


def down(machine: str):
    return ev_("MachinesStatusChanged", {"status": "DOWN", "reason": "health_check",
                                         "machines": [{"machine_id": machine, "previous_status": "UP"}]},
               ENT, ENT, "health")


def heartbeat(machine: str, ts: int):
    return ev_("AgentHeartbeat", {"machine_id": machine, "running_task_ids": [], "sequence": 10**9}, "", machine,
               f"agent/{machine}", ts)


def log_records(cfg: Config, registry: SchemaRegistry, logical: str) -> list[tuple[str, dict, bytes]]:
    """(type, record, bytes) of every record of a topic now, read as the operator, undecodable ones left out."""
    topics = Topics(cfg.topic_prefix, cfg.partitions)
    c = Consumer(cfg.kafka_conf(**{"group.id": reader_group(cfg, "forgery-test"), "enable.partition.eof": True,
                                   "log_level": 0}))
    name = topics.name(logical)
    parts = sorted(c.list_topics(name, timeout=10).topics[name].partitions)
    c.assign([TopicPartition(name, p, OFFSET_BEGINNING) for p in parts])
    out, eof = [], set()
    deadline = time.monotonic() + 30
    try:
        while len(eof) < len(parts) and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                if m.error() is not None:
                    eof.add(m.partition())
                    continue
                try:
                    type_, rec = registry.decode(m.value())
                except Exception:  # noqa: BLE001 - not an event: not what is looked for
                    continue
                out.append((type_, rec, m.value()))
    finally:
        c.close()
    return out


def dead_letters(cfg: Config, registry: SchemaRegistry) -> dict[tuple[str, int, int], dict[str, str]]:
    """(origin topic, partition, offset) -> {consumer: reason} of every DeadLetterRecorded."""
    out: dict[tuple[str, int, int], dict[str, str]] = {}
    for type_, rec, _ in log_records(cfg, registry, "deadletter"):
        if type_ == "DeadLetterRecorded":
            out.setdefault((rec["origin_topic"], rec["origin_partition"], rec["origin_offset"]), {})[
                rec["consumer"]] = rec["reason"]
    return out


@pytest.mark.timeout(480)
def test_the_forgeries_of_issue_27_are_refused_change_nothing_and_are_dead_lettered(tmp_path):
    region = RegionCli(tmp_path / "run")
    agent_pid = None
    try:
        up = region.json("up", "--machines", "6")
        assert up and up["ready"] and up["demo"]["running"], up
        cfg = Config.from_env(region.env)
        machines = [m.id for m in iter_machines(load_region(region.run_dir / "region.yaml")) if m.id != LOCAL]
        attacker = Attacker(region, machines[0], tmp_path)
        registry = attacker.registry
        demo_pid = json.loads((region.run_dir / "agents" / LOCAL / "agent-state.json").read_text())["procs"][TASK]["pid"]
        before = region.status(JOB)
        assert [t["state"] for t in before["tasks"]] == ["RUNNING"]
        pwned = tmp_path / "pwned.txt"
        sched_key = json.loads((cfg.secrets / "agent.json").read_text())["trust"]["pinned"]["scheduler"]["key_id"]
        genuine = next(rec for t, rec, _ in log_records(cfg, registry, "tasks")
                       if t == "TasksCommanded" and rec["job_id"] == JOB and rec["commands"][0]["command"] == "START")

        # -- 1. a START with its own argv, for the demo task on the local machine, at a new spec version ----------
        own_argv = ["sh", "-c", f"id > {pwned}"]
        start = command("START", own_argv, spec_version=2)
        attacker.send("start unsigned", start, attacker.unsigned(start))
        start = command("START", own_argv, spec_version=2)
        attacker.send("start claiming the scheduler", start, attacker.claiming(start, "scheduler", sched_key))
        tampered = {**genuine, "argv": own_argv}  # the scheduler's own signed record, its argv changed
        attacker.send("start tampered", command("START"), registry.encode("TasksCommanded", tampered))
        # -- 2. four STOPs ------------------------------------------------------------------------------------------
        for i, make in enumerate((attacker.unsigned, attacker.unsigned,
                                  lambda e: attacker.claiming(e, "scheduler", sched_key), attacker.as_itself)):
            stop = command("STOP")
            attacker.send(f"stop {i}", stop, make(stop))
        # -- 3. four FAILED reports of the demo task, from another machine --------------------------------------
        report = failed_report()
        attacker.send("failed unsigned", report, attacker.unsigned(report))
        report = failed_report()
        attacker.send("failed under the attacker's key", report, attacker.as_itself(report))
        report = failed_report()
        attacker.send("failed as the scheduler", report, attacker.claiming(report, "scheduler"))
        report = failed_report()
        attacker.send("failed as the local machine", report, attacker.claiming(report, f"machine/{LOCAL}"))
        # -- 4. the healthy local machine DOWN, "from the health check" ---------------------------------------------
        for name, make in (("down unsigned", attacker.unsigned), ("down as health",
                                                                  lambda e: attacker.claiming(e, "health")),
                           ("down under the attacker's key", attacker.as_itself)):
            ev = down(LOCAL)
            attacker.send(name, ev, make(ev))
        # -- 5. heartbeats dated a day ahead: the local machine's, forged; the attacker's own, proven --------------
        now = int(time.time() * 1000)
        beat = heartbeat(LOCAL, now + DAY_MS)
        attacker.send("heartbeat ahead unsigned", beat, attacker.unsigned(beat))
        beat = heartbeat(LOCAL, now + DAY_MS)
        attacker.send("heartbeat ahead as the local machine", beat, attacker.claiming(beat, f"machine/{LOCAL}"))
        beat = heartbeat(attacker.machine, now + DAY_MS)
        attacker.send("heartbeat ahead, the attacker's own", beat, attacker.as_itself(beat))
        # -- 6. a registration of a 1,000,000-millicore machine ----------------------------------------------------
        phantom = "dc1-msb1-r01-m999"
        reg = ev_("MachineRegistered", {"machine_id": phantom, "topology": {"region": "r", "dc": "dc1", "msb": "msb1",
                                                                           "rack": "r01"},
                                        "machine_type": "t1", "capacity": {"cpu_millicores": 1_000_000,
                                                                           "memory_mib": 1_000_000},
                                        "host_profile": None}, "free/dc1", phantom, "resourcebroker")
        attacker.send("registration unsigned", reg, attacker.unsigned(reg))
        reg = ev_(reg.type, reg.payload, "free/dc1", phantom, "resourcebroker")
        attacker.send("registration as the resource broker", reg, attacker.claiming(reg, "resourcebroker"))
        # -- 7. a host-profile answer for the local machine ------------------------------------------------------
        answer = ev_("HostProfileApplied", {"machine_id": LOCAL, "host_profile": "web", "previous_host_profile": "",
                                            "request_id": "forged"}, ENT, LOCAL, f"agent/{LOCAL}")
        attacker.send("profile answer unsigned", answer, attacker.unsigned(answer))
        answer = ev_(answer.type, answer.payload, ENT, LOCAL, f"agent/{LOCAL}")
        attacker.send("profile answer under the attacker's key", answer, attacker.as_itself(answer))

        # -- each is in the dead letters, with its reason, from the readers that refused it ------------------------
        want = {
            "start unsigned": ({f"agent/{LOCAL}"}, "unsigned"),
            "start claiming the scheduler": ({f"agent/{LOCAL}"}, "bad_proof"),
            "start tampered": ({f"agent/{LOCAL}"}, "bad_proof"),
            **{f"stop {i}": ({f"agent/{LOCAL}"}, ("unsigned", "unsigned", "bad_proof", "wrong_identity")[i])
               for i in range(4)},
            "failed unsigned": ({"scheduler"}, "unsigned"),
            "failed under the attacker's key": ({"scheduler"}, "bad_proof"),
            "failed as the scheduler": ({"scheduler"}, "bad_proof"),
            "failed as the local machine": ({"scheduler"}, "bad_proof"),
            "down unsigned": (MACHINE_READERS | {"scheduler", "health"}, "unsigned"),
            "down as health": (MACHINE_READERS | {"scheduler", "health"}, "bad_proof"),
            "down under the attacker's key": (MACHINE_READERS | {"scheduler", "health"}, "wrong_identity"),
            "heartbeat ahead unsigned": ({"health"}, "unsigned"),
            "heartbeat ahead as the local machine": ({"health"}, "bad_proof"),
            "heartbeat ahead, the attacker's own": ({"health"}, "from_the_future"),
            "registration unsigned": (MACHINE_READERS, "unsigned"),
            "registration as the resource broker": (MACHINE_READERS, "bad_proof"),
            "profile answer unsigned": (MACHINE_READERS, "unsigned"),
            "profile answer under the attacker's key": (MACHINE_READERS, "wrong_identity"),
        }
        assert set(want) == set(attacker.sent)

        def missing():
            got = dead_letters(cfg, registry)
            return {name: (readers - set(got.get(attacker.sent[name], {})), got.get(attacker.sent[name], {}))
                    for name, (readers, _) in want.items() if readers - set(got.get(attacker.sent[name], {}))}, got
        region.wait_for(lambda: not missing()[0], "every forgery dead-lettered by its readers", timeout_s=120)
        got = missing()[1]
        for name, (readers, reason) in want.items():
            reasons = got[attacker.sent[name]]
            assert {reasons[r] for r in readers} == {reason}, (name, reasons)

        # -- the process agent answered each forged command, and ran nothing -----------------------------------------
        refused = {rec["command_id"]: rec for t, rec, _ in log_records(cfg, registry, "tasks")
                   if t == "TaskCommandRefused" and rec["task_id"] == TASK}
        assert len(refused) == 7, refused  # 3 STARTs, 4 STOPs (the tampered START's command ids are the genuine's)
        assert {r["reason"] for r in refused.values()} == {"unsigned", "bad_proof", "wrong_identity"}, refused
        assert not pwned.exists()
        # -- and nothing changed: the demo task runs, the same process; the machine is UP, has no profile "web"; no
        #    phantom machine
        state = json.loads((region.run_dir / "agents" / LOCAL / "agent-state.json").read_text())
        assert state["procs"][TASK]["pid"] == demo_pid and os.path.exists(f"/proc/{demo_pid}")
        after = region.status(JOB)
        assert ([(t["state"], t["machine"], t["spec_version"]) for t in after["tasks"]]
                == [("RUNNING", LOCAL, 1)]), after
        assert (after["spec_version"], after["incarnation"]) == (before["spec_version"], before["incarnation"])
        listed = {m["id"]: m for m in region.json("machine", "list")}
        assert phantom not in listed
        assert listed[LOCAL]["status"] == "UP" and listed[LOCAL]["host_profile"] in ("", None), listed[LOCAL]

        # -- replay: every record of tasks, machines and heartbeats with its proven identity; no forgery in it -----
        docs = region.replay()
        at = {(Topics(cfg.topic_prefix).logical(t), p, o): name for name, (t, p, o) in attacker.sent.items()}
        shown = [d for d in docs if d.get("topic") in auth.AUTHENTICATED]
        in_replay = {at[k]: d for d in shown if (k := (d["topic"], d["partition"], d["offset"])) in at}
        # only the attacker's own heartbeat is there, as the attacker's (its proof is true; its date is what the health
        # check refused): no forgery passes for anybody else
        assert list(in_replay) == ["heartbeat ahead, the attacker's own"], list(in_replay)
        assert in_replay["heartbeat ahead, the attacker's own"]["identity"] == f"machine/{attacker.machine}"
        assert all(d["identity"] for d in shown), [d for d in shown if not d["identity"]][:3]
        by_type = {}
        for d in shown:
            by_type.setdefault(d["type"], set()).add(d["identity"])
        assert by_type["TasksCommanded"] <= {"scheduler", "operator"}
        assert by_type["AgentHeartbeat"] <= {f"machine/{m}" for m in (*machines, LOCAL)}
        assert all(i.startswith("machine/") for i in by_type["TaskCommandRefused"])
        assert {d["identity"] for d in shown if d["type"] == "MachinesRegistered"} == {"resourcebroker"}

        # -- the health check is not blinded: the local agent stopped, its machine is no longer UP ----------------
        agent_pid = worker_pid(cfg, "agent-local")
        os.kill(agent_pid, signal.SIGSTOP)  # silent, alive: the supervisor does not start another
        region.wait_for(lambda: {m["id"]: m for m in region.json("machine", "list")}[LOCAL]["status"] != "UP",
                        "the stopped agent's machine judged silent", timeout_s=90)
    finally:
        if agent_pid is not None:
            os.kill(agent_pid, signal.SIGCONT)
        region("down")
