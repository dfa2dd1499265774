"""Configuration from environment variables, so that pointing Ropewalk at a real Kafka cluster and a
real Redis needs no code change.

| variable                    | default                              | meaning                                   |
|-----------------------------|--------------------------------------|-------------------------------------------|
| ROPEWALK_BOOTSTRAP_SERVERS  | 127.0.0.1:$ROPEWALK_BROKER_PORT       | Kafka bootstrap servers. When set, `up` does not start the embedded broker. |
| ROPEWALK_REDIS_URL          | redis://127.0.0.1:$ROPEWALK_REDIS_PORT/0 | Redis. When set, `up` does not start a private redis-server. |
| ROPEWALK_BROKER_PORT        | 19092                                | port of the embedded broker (its clients) |
| ROPEWALK_CONTROLLER_PORT    | $ROPEWALK_BROKER_PORT + 1            | port of the embedded broker's KRaft controller |
| ROPEWALK_BROKER_HEAP_MB     | 512                                  | the embedded broker's Java heap (-Xmx)    |
| ROPEWALK_REDIS_PORT         | 16379                                | port of the private redis-server          |
| ROPEWALK_RUN_DIR            | <project>/.run                       | pids, logs, redis dir, archives           |
| ROPEWALK_PARTITIONS         | 8                                    | partitions of every entitlement-keyed topic |
| ROPEWALK_TOPIC_PREFIX       | ""                                   | prefix of every topic name (isolates tests, or several regions on one cluster) |
| ROPEWALK_MAX_TASKS_PER_JOB  | 25000                                | the most tasks a job may have: `job submit` refuses more, the scheduler rejects more with a reason (Twine's largest jobs have ~15K tasks) |
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_BROKER_PORT = 19092
DEFAULT_REDIS_PORT = 16379
DEFAULT_PARTITIONS = 8
DEFAULT_BROKER_HEAP_MB = 512
# Twine (OSDI 2020, §5 "the largest job has ≈15K tasks"): 25,000 serves every job the paper reports, with room.
DEFAULT_MAX_TASKS_PER_JOB = 25_000


@dataclass(frozen=True)
class Config:
    bootstrap_servers: str
    redis_url: str
    broker_port: int
    redis_port: int
    controller_port: int  # the embedded broker's KRaft controller listener
    broker_heap_mb: int  # the embedded broker's -Xmx
    run_dir: Path
    partitions: int
    topic_prefix: str
    embedded_broker: bool  # True when Ropewalk itself runs the broker (no ROPEWALK_BOOTSTRAP_SERVERS)
    embedded_redis: bool  # True when Ropewalk itself runs redis-server (no ROPEWALK_REDIS_URL)
    max_tasks_per_job: int = DEFAULT_MAX_TASKS_PER_JOB  # job submit and the scheduler refuse bigger jobs

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        env = dict(os.environ if env is None else env)
        broker_port = _int(env, "ROPEWALK_BROKER_PORT", DEFAULT_BROKER_PORT)
        redis_port = _int(env, "ROPEWALK_REDIS_PORT", DEFAULT_REDIS_PORT)
        bootstrap = env.get("ROPEWALK_BOOTSTRAP_SERVERS", "").strip()
        redis_url = env.get("ROPEWALK_REDIS_URL", "").strip()
        partitions = _int(env, "ROPEWALK_PARTITIONS", DEFAULT_PARTITIONS)
        heap = _int(env, "ROPEWALK_BROKER_HEAP_MB", DEFAULT_BROKER_HEAP_MB)
        if heap < 128:
            raise ValueError(f"ROPEWALK_BROKER_HEAP_MB must be >= 128, got {heap}")
        if partitions < 1:
            raise ValueError(f"ROPEWALK_PARTITIONS must be >= 1, got {partitions}")
        max_tasks = _int(env, "ROPEWALK_MAX_TASKS_PER_JOB", DEFAULT_MAX_TASKS_PER_JOB)
        if max_tasks < 1:
            raise ValueError(f"ROPEWALK_MAX_TASKS_PER_JOB must be >= 1, got {max_tasks}")
        return cls(
            bootstrap_servers=bootstrap or f"127.0.0.1:{broker_port}",
            redis_url=redis_url or f"redis://127.0.0.1:{redis_port}/0",
            broker_port=broker_port,
            redis_port=redis_port,
            controller_port=_int(env, "ROPEWALK_CONTROLLER_PORT", broker_port + 1),
            broker_heap_mb=heap,
            run_dir=Path(env.get("ROPEWALK_RUN_DIR") or PROJECT_ROOT / ".run"),
            partitions=partitions,
            topic_prefix=env.get("ROPEWALK_TOPIC_PREFIX", ""),
            embedded_broker=not bootstrap,
            embedded_redis=not redis_url,
            max_tasks_per_job=max_tasks,
        )

    def with_(self, **changes) -> "Config":
        return replace(self, **changes)


def _int(env: dict[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
