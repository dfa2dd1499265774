"""The demo of ``ropewalk up``: entitlement ``demo`` and job ``demo.hello``, one task running as a real process on
the local machine under the process agent (processors/frontend/commands/region.py starts it).

The imports inside ``_start_demo`` and ``_send`` are start-up cost: ``ropewalk --help`` does not load the broker's
client, the state readers or the control plane.
"""
from __future__ import annotations

import time

from infra.config import Config
from infra.credentials import OPERATOR
from processors.frontend.console import _registry, _require_broker
from processors.frontend.jobspec import validate_spec
from processors.frontend.service import job_view
from streams.events import new_event

DEMO_ENTITLEMENT = "demo"
DEMO_JOB = "hello"
DEMO_COMMAND = ["sh", "-c", "while true; do echo \"hello from Ropewalk at $(date)\"; sleep 5; done"]
DEMO_WAIT_S = 60.0


def _start_demo(cfg: Config, skipped, *, say=lambda made: None) -> dict | None:
    """The demo of `up`: entitlement ``demo`` (1 machine of the process type) and job ``demo.hello``, one task
    filling the local machine, so it runs as an OS process under the process agent. Waits (bounded) until it
    runs; its state is reported either way. Submitting it again (a second `up`) changes nothing. It is made only in
    a region that holds no job (a new region, a new log, or one whose every job ended and left: ``state.jobs``): a
    region in use gets no job it did not ask for (one started with ``--no-demo``, brought back after a power loss);
    None then. ``say(made)`` before the wait:
    whether the demo was made now."""
    from processors import controlplane  # noqa: PLC0415 - start-up: the control plane (~40 ms)
    from streams import state  # noqa: PLC0415 - start-up: confluent-kafka (~40 ms)

    registry = _registry()
    job_id = f"{DEMO_ENTITLEMENT}.{DEMO_JOB}"
    jobs = state.current(cfg, registry, "jobs", skipped=skipped)
    made = jobs.get(job_id) is None
    if made:
        if jobs:  # a region in use, without the demo
            return None
        ent = new_event("EntitlementCreated", {"name": DEMO_ENTITLEMENT, "quota_machines": 1,
                                               "machine_type": controlplane.LOCAL_MACHINE_TYPE, "dc_pin": None,
                                               "host_profile": None},
                        entitlement=DEMO_ENTITLEMENT, entity_id=DEMO_ENTITLEMENT, producer="cli", principal=OPERATOR)
        spec = {"name": DEMO_JOB, "entitlement": DEMO_ENTITLEMENT, "tasks": 1, "command": DEMO_COMMAND,
                "resources": {"cpu_millicores": controlplane.LOCAL_CPU_MILLICORES,
                              "memory_mib": controlplane.LOCAL_MEMORY_MIB},
                "requirements": {"machine_type": controlplane.LOCAL_MACHINE_TYPE}}
        payload = validate_spec(spec)
        payload.pop("entitlement")
        job = new_event("JobSubmitted", {**payload, "spec_version": 1}, entitlement=DEMO_ENTITLEMENT,
                        entity_id=job_id, producer="cli", principal=OPERATOR)
        _send(cfg, registry, [ent, job])
    say(made)
    deadline = time.monotonic() + DEMO_WAIT_S
    view = None
    while time.monotonic() < deadline:
        latest = state.current(cfg, registry, "jobs", skipped=skipped).get(job_id)
        view = job_view(latest) if latest is not None else None
        if view and view["tasks"] and all(t["state"] == "RUNNING" for t in view["tasks"]):
            break
        time.sleep(0.5)
    task = view["tasks"][0]["id"] if view and view["tasks"] else None
    from processors.agent.process import default_work_dir, task_log  # noqa: PLC0415 - start-up: the agent (~0.18 s)

    logs = task_log(default_work_dir(cfg.run_dir, controlplane.LOCAL_MACHINE_ID), task or "<task>")
    return {"job": job_id, "state": view["state"] if view else "SUBMITTED", "command": DEMO_COMMAND,
            "running": bool(view and view["tasks"] and all(t["state"] == "RUNNING" for t in view["tasks"])),
            "logs": str(logs)}


def _send(cfg: Config, registry, events: list) -> None:
    from streams.clients import EventProducer  # noqa: PLC0415 - start-up: confluent-kafka (~35 ms)

    _require_broker(cfg)
    producer = EventProducer(cfg, registry, "cli", **{"message.timeout.ms": 15000})
    for ev in events:
        producer.send(ev)
    producer.flush(20)
