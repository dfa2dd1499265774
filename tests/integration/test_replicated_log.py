"""A replicated log (issue #26, item 1), on a region a user starts: `ropewalk up --brokers 3 --machines 20`.

Three embedded Kafka nodes (one JVM each, each a broker and a KRaft voter), every topic replicated 3 times with
`min.insync.replicas=2`, every producer `acks=all` and idempotent, the nodes run by the region's supervisor. During a
burst of job submissions one node is killed with SIGKILL, twice: first the KRaft quorum's leader (the active
controller), then the leader of the partition the burst writes to. Each time the region goes on (every submission
answered, no worker dies), the supervisor starts the node again, and it catches up: back in the in-sync replicas of
every partition it holds. Then the replayed log and Redis show nothing lost or applied twice (the kill storm's
checker, ``bench/killstorm.check``): every job RUNNING, no task placed on two machines nor running on two, no event
id on the log twice, Redis equal to a rebuild from the log. `ropewalk status` lists each node; `down` stops them
and `up` (without --brokers) resumes the same cluster, the jobs still running.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from bench.killstorm import Options, Workload, check, settle
from infra import broker as embedded_kafka
from infra import credentials, services
from infra.config import Config
from infra.process import free_port_block, pid_alive
from regioncli import RegionCli
from streams.partitioner import partition_for
from streams.serde import SchemaRegistry
from streams.topics import Topics

pytestmark = pytest.mark.long  # `make test-long`: CI's kill storm kills broker nodes in brief

BROKERS = 3
JOBS_PER_BURST = 4
TASKS = 2
WORKERS = {"resourcebroker", "allocator-0", "scheduler-0", "agents", "agent-local", "health", "api", "rebalancer",
           "sidekick", "jobcontrol", "srm", "loans"}


def job_spec(path, name: str) -> str:
    path.write_text(f"name: {name}\nentitlement: e1\ntasks: {TASKS}\ncommand: [sleep, '3600']\n"
                    "resources: {cpu_millicores: 250, memory_mib: 256}\n")
    return str(path)


def nodes_in_sync(cfg: Config, node: int) -> dict | None:
    """The cluster's state once ``node`` runs again, every node is in the cluster and no partition is under-replicated
    (the node back in the in-sync replicas of every partition it holds); else None."""
    st = services.cluster_state(cfg)
    if st["error"] or st["nodes"] != [n.id for n in cfg.broker_nodes] or st["under_replicated"] or st["leaderless"]:
        return None
    return st if not st["out_of_sync"].get(node) else None


def leader_of(cfg: Config, topic: str, partition: int) -> int:
    md = AdminClient({**embedded_kafka.admin_conf(cfg), "log_level": 0}).list_topics(topic, timeout=10)
    return md.topics[topic].partitions[partition].leader


@pytest.mark.timeout(900)
def test_a_broker_killed_in_a_burst_loses_nothing_and_rejoins_its_replicas(tmp_path):
    base = free_port_block(2 * BROKERS)  # node i on base + 2i (clients) and base + 2i + 1 (its controller)
    region = RegionCli(tmp_path / "run", ROPEWALK_BROKER_PORT=str(base), ROPEWALK_CONTROLLER_PORT=str(base + 1))
    try:
        up = region("up", "--brokers", str(BROKERS), "--machines", "20", "--no-demo", timeout_s=600)
        assert up.returncode == 0, up.stderr
        assert "a cluster of 3 nodes" in up.stdout and "topics replicated 3 times" in up.stdout, up.stdout
        cfg = Config.from_env(region.env)  # no ROPEWALK_BROKERS: the run directory's cluster (3 nodes)
        assert cfg.brokers == BROKERS and len(cfg.bootstrap_servers.split(",")) == BROKERS
        doc = region.json("status")
        names = [f"broker-{i}" for i in range(1, BROKERS + 1)]
        assert doc and all(doc["components"][n]["ready"] for n in names), doc and doc["components"]
        assert all(doc["programs"][n]["state"] == "RUNNING" for n in names)  # supervised, as services
        # Every principal's SCRAM user is let in by every node (ensure_users waited for it at `up`).
        for principal in credentials.PRINCIPALS:
            who = credentials.kafka_credentials(cfg.secrets, principal)
            assert all(embedded_kafka.authenticates(n, who.username, who.password) for n in cfg.broker_nodes), principal
        # Every topic replicated 3 times, 2 in sync for a write: the catalogue's, faust's changelogs, the internal ones
        admin = AdminClient({**embedded_kafka.admin_conf(cfg), "log_level": 0})
        topics = admin.list_topics(timeout=10).topics
        assert any(t.startswith("scheduler-") for t in topics) and "__consumer_offsets" in topics
        assert {len(p.replicas) for t in topics.values() for p in t.partitions.values()} == {BROKERS}
        for t in ("intents", "scheduler-scheduler-jobs-changelog", "__consumer_offsets"):
            conf = admin.describe_configs([ConfigResource("topic", t)])
            value = next(iter(conf.values())).result()["min.insync.replicas"].value
            assert value == "2", (t, value)

        region.ok("entitlement", "create", "e1", "--quota", "20")
        intents = Topics(cfg.topic_prefix, cfg.partitions).name("intents")
        e1_partition = partition_for("e1", cfg.partitions)
        jobs: list[str] = []
        kills = []
        figures: list[str] = []  # printed at the end (RELIABILITY.md quotes them)
        for round_, victim_of in enumerate((
                lambda: embedded_kafka.quorum_leader(cfg),  # the active controller
                lambda: leader_of(cfg, intents, e1_partition))):  # the leader the burst writes to
            victim = victim_of()
            assert victim in range(1, BROKERS + 1), victim
            pid = int((tmp_path / "run" / f"broker-{victim}.pid").read_text())
            for i in range(JOBS_PER_BURST):
                name = f"r{round_}j{i}"
                out = region("job", "submit", job_spec(tmp_path / f"{name}.yaml", name))
                assert out.returncode == 0, (name, out.stderr)  # answered: the region goes on
                jobs.append(f"e1.{name}")
                if i == 0:  # the burst has begun: the victim dies under it
                    os.kill(pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                    kills.append((victim, pid))
            # The supervisor starts it again; it catches up and is back in every partition's in-sync replicas.
            region.wait_for(lambda: not pid_alive(pid), f"broker-{victim} gone")
            back = region.wait_for(lambda: (s := region.json("status")) and s["components"][f"broker-{victim}"]["ready"]
                                   and s, f"broker-{victim} back in the cluster", timeout_s=240)
            assert back["programs"][f"broker-{victim}"]["restarts"] == sum(1 for v, _ in kills if v == victim)
            assert back["programs"][f"broker-{victim}"]["last_exit"]["signal"] == "SIGKILL"
            back_s = time.monotonic() - killed_at
            region.wait_for(lambda: nodes_in_sync(cfg, victim), f"broker-{victim} in sync", timeout_s=240)
            figures.append(f"round {round_}: broker-{victim} killed; {JOBS_PER_BURST} submissions answered; back in "
                           f"the cluster {back_s:.0f} s and in sync {time.monotonic() - killed_at:.0f} s after the kill")

        for job in jobs:
            region.wait_for(lambda: region.running(job, TASKS), f"{job} running", timeout_s=240)
        # No worker died of it.
        doc = region.json("status")
        assert doc is not None
        assert {n: w["restarts"] for n, w in doc["control_plane"].items() if w["restarts"]} == {}
        assert set(doc["control_plane"]) == WORKERS

        # The log and Redis: nothing lost, placed twice, running twice; no event id twice; Redis = a rebuild (once
        # the allocator is idle and has projected the last of the log: check waits for it, redis_caught_up).
        registry = SchemaRegistry.from_dir()
        settle(cfg)
        opts = Options(machines=20, partitions=cfg.partitions)

        work = Workload(random.Random(0), opts, ["e1"], live={j: ("e1", TASKS) for j in jobs})
        r = cfg.redis_client()
        try:
            counts = check(cfg, registry, work, r)
        finally:
            r.close()
        assert (counts["tasks_lost"], counts["tasks_placed_twice"], counts["tasks_running_twice"],
                counts["machines_overcommitted"], counts["quota_breaches"]) == (0, 0, 0, 0, 0), counts
        assert counts["duplicate_records"] == 0 and counts["conflicting_duplicates"] == 0, counts
        assert counts["redis_matches_log"], counts["redis_differences"]
        replayed = region.replay()  # every topic the API replays
        ids = Counter(ev["event_id"] for ev in replayed)
        assert ids and max(ids.values()) == 1, [i for i, n in ids.items() if n > 1][:5]
        silent = sum(len(ev["payload"]["machine_ids"]) for ev in replayed
                     if ev["type"] == "UnavailabilityStarted" and ev["producer"] == "health")
        figures.append(f"{len(replayed)} records replayed, 0 event ids twice; {counts['tasks_placed']} tasks placed; "
                       f"machines judged silent by the health check meanwhile: {silent}")

        # `down` stops every node; `up` without --brokers resumes the same cluster, the jobs where they were.
        pids = {n: doc["programs"][n]["pid"] for n in names}
        down = region("down")
        assert down.returncode == 0 and all(f"{n}: stopped" in down.stdout for n in names), down.stdout
        assert not any(pid_alive(p) for p in pids.values())
        cluster_id = json.loads((tmp_path / "run" / "kafka" / "cluster.json").read_text())["cluster_id"]
        again = region("up", "--machines", "20", "--no-demo", timeout_s=600)
        assert again.returncode == 0 and "a cluster of 3 nodes" in again.stdout, again.stderr
        assert json.loads((tmp_path / "run" / "kafka" / "cluster.json").read_text())["cluster_id"] == cluster_id
        for job in jobs:
            region.wait_for(lambda: region.running(job, TASKS), f"{job} running after up", timeout_s=240)
        refused = region("up", "--brokers", "1", "--machines", "20", "--no-demo")
        assert refused.returncode != 0 and "is a cluster of 3 nodes, not 1" in refused.stderr, refused.stderr
        print("\n".join(figures))
    finally:
        region("down")
