"""`ropewalk`: the command line of Ropewalk (contract in docs/architecture.md; outside tools script against it).

Every read command takes --json and prints one JSON document (replay: one JSON event per line); every
command exits non-zero with a one-line reason on error. A record a command's readers cannot decode is skipped
and counted; the command goes on and says so once, in one line on stderr, when it ends (``args.skipped``; on an
error, at the end of the error's line).

**Through the API, or on the log.** The user's commands (entitlement, job, machine, maintenance, replay, watch) go
through the region's HTTP API (``ROPEWALK_API_URL``, default ``http://127.0.0.1:$ROPEWALK_API_PORT``) with the token
``ROPEWALK_TOKEN`` (default: the region administrator's, ``<secrets>/token``), which authorizes them
(processors/api). ``--direct`` (or ``ROPEWALK_DIRECT=1``) does them on the log itself as broker principal
``operator`` (the operator's way, and the tests'): both ways run the same operations
(processors/frontend/service.py) and print the same documents. The operator's commands (up, down, status, produce,
rebuild, archive, restore, user, bench) always act directly.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import json
import sys
import time
from pathlib import Path

from infra.config import Config
from processors.frontend.console import (  # what every command uses (processors/frontend/commands/ too)
    AT_HELP, CliError, Progress, _ago, _duration_ms, _front, _parse_time, _print, _registry, _require_broker, _table,
    _verdict, _wait_s, command, direct, human_time, user_command,
)
from processors.frontend.console import task_counts as _task_counts


def _topics(cfg: Config):
    from streams.topics import Topics

    return Topics(cfg.topic_prefix, cfg.partitions)


def _admin(cfg: Config):
    from confluent_kafka.admin import AdminClient

    return AdminClient({**cfg.kafka_conf(), "log_level": 0})


# --- up / down / status -------------------------------------------------------------------------
def cmd_up(cfg: Config, args) -> int:
    t0 = time.monotonic()
    with Progress() as step:  # each step on stderr as it goes (processors/frontend/console.py)
        return _up(cfg, args, t0, step)


def _up(cfg: Config, args, t0: float, step: Progress) -> int:
    from infra import acls, services
    from infra.config import remember_endpoints
    from processors import controlplane
    from streams.topics import provision, replication_factor

    cfg = _with_brokers(cfg, args.brokers)
    running = controlplane.running_counts(cfg)
    try:  # refused before anything starts
        controlplane.check_counts(cfg, args.schedulers if args.schedulers is not None else running["scheduler"] or 1,
                                  args.allocators if args.allocators is not None else running["allocator"] or 1)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    step("starting the broker and Redis")
    try:
        st = services.up(cfg)
    except services.InfraError as exc:
        raise CliError(_remembered_hint(str(exc))) from None
    remember_endpoints()  # a new shell without the variables finds this region (infra/config.py)
    from infra.credentials import write_principal_files

    write_principal_files(cfg.secrets)  # one file per principal: what a worker on another machine is given
    admin = _admin(cfg)
    step("provisioning topics and ACLs")
    prov = provision(admin, _topics(cfg), replication=replication_factor(cfg, admin), conf=cfg.kafka_conf())
    cfg = cfg.with_(replication_factor=prov["replication_factor"])  # the workers' (faust's changelogs)
    acls.provision_region(cfg, admin)  # what each component's principal may do (infra/acls.py)
    from processors.api.users import ensure_admin

    ensure_admin(cfg.secrets)  # the API's region administrator; its token in <secrets>/token, for this CLI
    if args.machines > 0:
        step(f"starting the control plane; waiting until its {args.machines + 1} machines are in the allocator's "
             f"index (at most {controlplane.READY_TIMEOUT_S:.0f} s)")
    region = (controlplane.up(cfg, args.machines, schedulers=args.schedulers, allocators=args.allocators)
              if args.machines > 0 else {"workers": {}, "ready": True})
    cp = region["workers"]
    if args.machines > 0 and region["ready"] and not args.no_demo:
        step(f"starting the demo job {DEMO_ENTITLEMENT}.{DEMO_JOB} (at most {DEMO_WAIT_S:.0f} s)")
    demo = _start_demo(cfg, args.skipped) if args.machines > 0 and region["ready"] and not args.no_demo else None
    dead = [n for n, s in cp.items() if not s.get("running")]
    scrape = _scrape_targets(cfg) if cp else {}
    doc = {"broker": st["broker"], "redis": st["redis"], "topics_created": prov["created"],
           "topics": prov["topics"], "control_plane": cp, "machines": args.machines,
           "machines_up": region.get("machines_up", 0), "machines_indexed": region.get("machines_indexed", 0),
           "schedulers": region.get("schedulers"), "allocators": region.get("allocators"),
           "retired": sorted(region.get("retired") or ()),
           "ready": region["ready"], "demo": demo, "metrics": scrape,
           "seconds": round(time.monotonic() - t0, 2)}
    lines = [
        f"broker  {cfg.bootstrap_servers}  ({services.broker_text(cfg, st['broker']) if cfg.embedded_broker else 'external'}"
        f"; topics replicated {prov['replication_factor']} times)",
        f"redis   {cfg.redis_url}  ({'private redis-server, pid %s' % st['redis'].get('pid') if cfg.embedded_redis else 'external'})",
        f"topics  {len(prov['topics'])} ready ({len(prov['created'])} created), {cfg.partitions} partitions per entitlement-keyed topic",
        f"logs    {cfg.run_dir}",
    ]
    if cp:
        by_status = ", ".join(f"{n} {s}" for s, n in sorted(region["machines_by_status"].items()))
        lines.append(f"region  {region['machines_indexed']} machines in the index ({by_status}; {args.machines} "
                     f"simulated + {controlplane.LOCAL_MACHINE_ID} run by the process agent); workers: "
                     + ", ".join(f"{n} (pid {s.get('pid')})" for n, s in cp.items() if s.get("running"))
                     + (f"; stopped for good: {', '.join(sorted(region['retired']))}" if region.get("retired") else ""))
        if demo:
            lines.append(f"demo    job {demo['job']} ({demo['state']}) runs `{' '.join(demo['command'])}` as a real "
                         f"process on {controlplane.LOCAL_MACHINE_ID}; its output: {demo['logs']}")
        lines.append(f"api     {cfg.api_url} (OpenAPI: {cfg.api_url}/docs); the CLI's token: {cfg.secrets}/token "
                     f"(region admin); `ropewalk user add NAME --role E=operator` makes users")
        lines.append(f"ui      {cfg.api_url}/ui/ (sign in with the token)")
        lines.append(f"metrics Prometheus file_sd: {scrape['file_sd']} ({len(scrape['targets'])} targets: "
                     + ", ".join(f"{w} {a}" for w, a in scrape["targets"].items()) + ")")
        lines.append("next    ropewalk entitlement create e1 --quota 4 ; ropewalk job submit FILE ; "
                     "ropewalk job status JOB ; ropewalk watch jobs ; ropewalk replay ; ropewalk down")
    else:
        lines.append("next    ropewalk status | ropewalk produce intents EntitlementCreated FILE | ropewalk replay | ropewalk down")
    step.close()  # the display ends before the result
    _print(doc, args.json, "\n".join(lines))
    if dead:
        from infra.supervisor import exit_text

        raise CliError("control plane: " + "; ".join(f"{n} exited after its start ({exit_text(cp[n].get('last_exit'))}; "
                                                       f"the supervisor starts it again)" for n in dead)
                       + f"; see {cfg.run_dir}/<name>.log")
    if not region["ready"]:
        raise CliError(f"control plane: only {region['machines_indexed']} of {args.machines + 1} machines reached the "
                       f"allocator's index in {controlplane.READY_TIMEOUT_S:.0f} s; see {cfg.run_dir}/allocator-0.log")
    return 0


def _with_brokers(cfg: Config, brokers: int | None) -> Config:
    """`up --brokers N` (or ROPEWALK_BROKERS): the embedded cluster of N nodes; neither: the cluster the run directory
    holds (infra/config.held_brokers), else one node. Remembered with the endpoints, for `status` and `down` in
    another shell. (A run directory holding another number of nodes is refused when the broker starts.)"""
    from infra.config import check_brokers, held_brokers

    if not cfg.embedded_broker:
        if brokers is not None:
            raise CliError("--brokers: the broker is external (ROPEWALK_BOOTSTRAP_SERVERS); its nodes are yours to run")
        return cfg
    asked = brokers if brokers is not None else (cfg.brokers if os.environ.get("ROPEWALK_BROKERS") else None)
    try:
        cfg = cfg.with_brokers(check_brokers(asked or held_brokers(cfg.run_dir)))
    except ValueError as exc:
        raise CliError(f"--brokers: {exc}") from None
    os.environ["ROPEWALK_BROKERS"] = str(cfg.brokers)
    return cfg


def _remembered_hint(error: str) -> str:
    """``error`` of a service `up` could not reach, and, when the endpoints came from an earlier `up`
    (endpoints.json, infra/config.py) rather than this shell, that they did and how to forget them."""
    import os

    from infra.config import remembered_endpoints, remembered_from

    path = remembered_from(dict(os.environ))
    if path is None:
        return error
    names = ", ".join(f"{k}={v}" for k, v in sorted(remembered_endpoints(dict(os.environ)).items())
                      if k in ("ROPEWALK_BOOTSTRAP_SERVERS", "ROPEWALK_REDIS_URL", "ROPEWALK_BROKER_PORT",
                               "ROPEWALK_REDIS_PORT"))
    return (f"{error}; these endpoints were remembered from an earlier `ropewalk up` in {path} ({names}). If that "
            f"region is gone: `ropewalk down --forget` forgets them (or remove {path}), then `ropewalk up` starts "
            f"a new region; if it is only restarting, run `ropewalk up` again once it answers")


def _scrape_targets(cfg: Config) -> dict:
    """Where Prometheus scrapes the region (infra/metrics.py): every worker's port and the API's /metrics, also
    written as a file_sd_configs file."""
    from infra import metrics

    api = {"api": cfg.api_url.removeprefix("http://").removeprefix("https://")}
    return {"file_sd": str(metrics.write_file_sd(cfg.run_dir, extra=api)),
            "targets": {**metrics.targets(cfg.run_dir), **api}}


DEMO_ENTITLEMENT = "demo"
DEMO_JOB = "hello"
DEMO_COMMAND = ["sh", "-c", "while true; do echo \"hello from Ropewalk at $(date)\"; sleep 5; done"]
DEMO_WAIT_S = 60.0


def _start_demo(cfg: Config, skipped) -> dict:
    from infra.credentials import OPERATOR
    from processors.frontend.service import job_view

    """The demo of `up`: entitlement ``demo`` (1 machine of the process type) and job ``demo.hello``, one task
    filling the local machine, so it runs as an OS process under the process agent. Waits (bounded) until it
    runs; its state is reported either way. Submitting it again (a second `up`) changes nothing."""
    from processors import controlplane
    from streams import state
    from streams.events import new_event

    registry = _registry()
    job_id = f"{DEMO_ENTITLEMENT}.{DEMO_JOB}"
    if state.current(cfg, registry, "jobs", skipped=skipped).get(job_id) is None:
        ent = new_event("EntitlementCreated", {"name": DEMO_ENTITLEMENT, "quota_machines": 1,
                                               "machine_type": controlplane.LOCAL_MACHINE_TYPE, "dc_pin": None,
                                               "host_profile": None},
                        entitlement=DEMO_ENTITLEMENT, entity_id=DEMO_ENTITLEMENT, producer="cli", principal=OPERATOR)
        spec = {"name": DEMO_JOB, "entitlement": DEMO_ENTITLEMENT, "tasks": 1, "command": DEMO_COMMAND,
                "resources": {"cpu_millicores": controlplane.LOCAL_CPU_MILLICORES,
                              "memory_mib": controlplane.LOCAL_MEMORY_MIB},
                "requirements": {"machine_type": controlplane.LOCAL_MACHINE_TYPE}}
        from processors.frontend.jobspec import validate_spec

        payload = validate_spec(spec)
        payload.pop("entitlement")
        job = new_event("JobSubmitted", {**payload, "spec_version": 1}, entitlement=DEMO_ENTITLEMENT,
                        entity_id=job_id, producer="cli", principal=OPERATOR)
        _send(cfg, registry, [ent, job])
    deadline = time.monotonic() + DEMO_WAIT_S
    view = None
    while time.monotonic() < deadline:
        latest = state.current(cfg, registry, "jobs", skipped=skipped).get(job_id)
        view = job_view(latest) if latest is not None else None
        if view and view["tasks"] and all(t["state"] == "RUNNING" for t in view["tasks"]):
            break
        time.sleep(0.5)
    task = view["tasks"][0]["id"] if view and view["tasks"] else None
    from processors.agent.process import default_work_dir, task_log

    logs = task_log(default_work_dir(cfg.run_dir, controlplane.LOCAL_MACHINE_ID), task or "<task>")
    return {"job": job_id, "state": view["state"] if view else "SUBMITTED", "command": DEMO_COMMAND,
            "running": bool(view and view["tasks"] and all(t["state"] == "RUNNING" for t in view["tasks"])),
            "logs": str(logs)}


def cmd_down(cfg: Config, args) -> int:
    from infra import services
    from processors import controlplane

    if args.keep_tasks:
        controlplane.keep_tasks(cfg)
    st = services.down(cfg)
    lines = [f"{k}: {'stopped' if v.get('stopped') else 'was not running'}" for k, v in st.items()]
    if args.forget:
        from infra.config import forget_endpoints

        gone = forget_endpoints()
        st = {**st, "forgot": str(gone) if gone else None}
        lines.append(f"forgot the endpoints remembered in {gone}" if gone else "no endpoints were remembered")
    _print(st, args.json, "\n".join(lines) or "nothing to stop (external broker and Redis)")
    return 0


def cmd_status(cfg: Config, args) -> int:
    """The broker and Redis, the supervisor, and every worker it is to run (`up` said which) with its state and
    restarts; exit 1 when a service does not answer or an expected worker does not run."""
    from infra import services, supervisor
    from processors import controlplane

    st = services.status(cfg)
    programs = supervisor.programs_state(cfg.run_dir)
    workers = controlplane.status(cfg)
    sup_pid = supervisor.process(cfg.run_dir).pid()
    doc = {"components": st, "supervisor": {"running": sup_pid is not None, "pid": sup_pid},
           "control_plane": workers, "programs": programs, "topics": {}, "topic_offsets": {}, "restored": None}
    if st["broker"]["ready"]:
        from streams.archive import restore_note

        doc["topic_offsets"] = _topic_offsets(cfg)
        doc["topics"] = {t: o["records"] for t, o in doc["topic_offsets"].items()}  # as it always was: high - low
        doc["restored"] = restore_note(cfg)
    lines = [_table(["SERVICE", "STATE", "ENDPOINT", "PID", "RESTARTS", "DETAIL"],
                    [[name, "ready" if s["ready"] else "DOWN", s["endpoint"],
                      s.get("pid") if s.get("embedded") and s.get("pid") else "-",
                      programs[name]["restarts"] if name in programs else "-", s.get("detail") or ""]
                     for name, s in st.items()], "")]
    if programs:
        lines.append(f"supervisor {'running  pid %d' % sup_pid if sup_pid else 'NOT RUNNING (nothing restarts a worker that dies)'}")
    if workers:
        lines += ["", _table(["WORKER", "STATE", "PID", "RESTARTS", "LAST-EXIT", "LOG"],
                             [[name, w["state"], w["pid"] or "-", w["restarts"],
                               supervisor.exit_text(w.get("last_exit")) or "-", w["log"]]
                              for name, w in workers.items()], "")]
    if doc["topic_offsets"]:
        lines += ["", _topics_table(doc["topic_offsets"], doc["restored"])]
    _print(doc, args.json, "\n".join(lines))
    down = [n for n, w in programs.items() if not w["running"]] + ([supervisor.NAME] if programs and not sup_pid else [])
    if down and not args.json:
        print(f"ropewalk: not running: {', '.join(down)}", file=sys.stderr)
    return 0 if all(s["ready"] for s in st.values()) and not down else 1


def _topic_offsets(cfg: Config) -> dict[str, dict]:
    """Per topic, summed over its partitions: ``end_offsets`` (the high watermarks: the offset the next record
    gets), ``start_offsets`` (the low watermarks: where the log starts now) and ``records`` (end - start: the records
    the topic holds; for a compacted topic at most that many, as the cleaner removes a key's older records without
    moving the start), and whether it is ``compacted``."""
    from confluent_kafka import Consumer, TopicPartition

    from infra.acls import reader_group
    from streams.retry import watermark_offsets
    from streams.topics import CATALOGUE

    compacted = {_topics(cfg).name(s.name) for s in CATALOGUE if s.config.get("cleanup.policy") == "compact"}
    c = Consumer({**cfg.kafka_conf(), "group.id": reader_group(cfg, "status"), "log_level": 0})
    try:
        md = c.list_topics(timeout=5)
        out = {}
        for name in _topics(cfg).all():
            t = md.topics.get(name)
            if t is None or t.error is not None:
                continue
            marks = [watermark_offsets(c, TopicPartition(name, p), 5) for p in t.partitions]
            out[name] = {"partitions": len(marks), "start_offsets": sum(lo for lo, _ in marks),
                         "end_offsets": sum(hi for _, hi in marks), "records": sum(hi - lo for lo, hi in marks),
                         "compacted": name in compacted}
        return out
    finally:
        c.close()


def _topics_table(offsets: dict[str, dict], restored: dict | None) -> str:
    """`status`'s topics: records held and end offsets (``_topic_offsets``), and what a restore renumbered."""
    rows = [[t, o["partitions"], f"≤ {o['records']}" if o["compacted"] else o["records"], o["end_offsets"],
             "compacted: at most this many records" if o["compacted"] else ""] for t, o in offsets.items()]
    text = _table(["TOPIC", "PARTITIONS", "RECORDS", "END OFFSETS", ""], rows, "")
    if restored:
        moved = restored["offsets_moved"]
        text += (f"\nrestored from {restored['archive']} at {restored['restored_at']}: "
                 + (f"the restore renumbered the offsets of {len(moved)} partitions ({', '.join(moved[:6])}"
                    f"{' ...' if len(moved) > 6 else ''}), where the archived log had holes (compaction, retention): "
                    f"their end offsets are lower than the archived region's; every other partition has its "
                    f"archived offsets" if moved else "every partition has its archived offsets"))
    return text


# --- produce ------------------------------------------------------------------------------------
def cmd_produce(cfg: Config, args) -> int:
    from processors.frontend.produce import build_event, parse_documents
    from streams.clients import EventProducer

    text = sys.stdin.read() if args.file == "-" else _read(args.file)
    registry = _registry()
    events = [dataclasses.replace(build_event(registry, args.topic, args.event_type, d, args.entitlement,
                                              max_tasks=cfg.max_tasks_per_job), principal=cfg.principal)
              for d in parse_documents(text)]  # the envelope names who produced it: the operator
    _require_broker(cfg)
    producer = EventProducer(cfg, registry, "cli", **{"message.timeout.ms": 15000})
    for ev in events:
        producer.send(ev, topic=args.topic)
    producer.flush(20)
    ids = [ev.event_id for ev in events]
    _print({"produced": len(ids), "topic": args.topic, "event_ids": ids}, args.json, "\n".join(ids))
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}") from None


# --- entitlements and jobs ---------------------------------------------------------------------
def _send(cfg: Config, registry, events: list) -> None:
    from streams.clients import EventProducer

    _require_broker(cfg)
    producer = EventProducer(cfg, registry, "cli", **{"message.timeout.ms": 15000})
    for ev in events:
        producer.send(ev)
    producer.flush(20)


def cmd_entitlement_create(cfg: Config, args) -> int:
    from processors import rules
    from processors.frontend.jobspec import JobSpecError, _name, refuse

    fields = {"name": "NAME", "quota_machines": "--quota"}
    payload = {"name": args.name, "quota_machines": args.quota, "machine_type": args.machine_type, "dc_pin": args.dc,
               "host_profile": args.host_profile}
    try:  # at the door, naming the flag (the API and the scheduler check again)
        name = _name(args.name, "NAME")
        refuse(rules.intent_problems("EntitlementCreated", payload, name), fields)
    except JobSpecError as exc:
        raise CliError(str(exc)) from None
    doc = _front(cfg, args).entitlement_create(name, args.quota, machine_type=args.machine_type, dc=args.dc,
                                               host_profile=args.host_profile, fields=fields)
    _print(doc, args.json, doc["entitlement"])
    return 0


def cmd_entitlement_update(cfg: Config, args) -> int:
    changes = {"quota_machines": args.quota, "machine_type": args.machine_type, "dc_pin": args.dc,
               "host_profile": args.host_profile}
    if all(v is None for v in changes.values()):
        raise CliError("nothing to change: give --quota, --machine-type, --dc or --host-profile")
    doc = _front(cfg, args).entitlement_update(args.name, changes)
    _print(doc, args.json, doc["entitlement"])
    return 0


def _partition_cell(row: dict) -> str:
    """Where an entitlement lives (its scheduler shard's partition), and where it moves to if it does."""
    if row.get("partition") is None:
        return "-"
    return f"{row['partition']}->{row['moving_to']}" if row.get("moving_to") is not None else str(row["partition"])


def cmd_entitlement_move(cfg: Config, args) -> int:
    doc = _front(cfg, args).entitlement_move(args.name, args.partition, args.reason,
                                             wait_s=None if args.no_wait else args.wait_s)
    text = (f"{doc['entitlement']}: {doc['state']} from partition {doc['from_partition']} to "
            f"{doc['to_partition']}")
    _print(doc, args.json, text)
    if doc["state"] not in ("moved", "requested"):
        raise CliError(f"{doc['entitlement']} did not arrive on partition {doc['to_partition']} within "
                       f"{args.wait_s:.0f} s (state: {doc['state']}); `ropewalk entitlement get {doc['entitlement']}` "
                       f"shows where it lives")
    return 0


def cmd_entitlement_list(cfg: Config, args) -> int:
    rows = _front(cfg, args).entitlements()
    if getattr(args, "name", None) is not None:  # `entitlement get NAME`
        found = [r for r in rows if r["entitlement"] == args.name]
        if not found:
            raise CliError(f"no entitlement {args.name!r} (or not one you may see); `ropewalk entitlement list` "
                           f"shows them")
        rows = found
    _print(rows[0] if getattr(args, "name", None) is not None else rows, args.json,
           _table(["ENTITLEMENT", "QUOTA", "MACHINE-TYPE", "DC", "HOST-PROFILE", "PARTITION"],
                  [[r["entitlement"], r["quota_machines"], r["machine_type"] or "-", r["dc_pin"] or "-",
                    r.get("host_profile") or "-", _partition_cell(r)] for r in rows], "no entitlements"))
    return 0


def _spec_data(path: str, entitlement: str | None, max_tasks: int):
    """The spec file, parsed and checked at the door (the error names the file and the field)."""
    from processors.frontend.jobspec import JobSpecError, parse_text
    from processors.frontend.service import spec_payload

    try:
        data = parse_text(_read(path), path)
    except JobSpecError as exc:
        raise CliError(f"{path}: {exc}") from None
    payload = spec_payload(data, entitlement, max_tasks, f"{path}: ")
    return data, payload


def cmd_job_submit(cfg: Config, args) -> int:
    data, payload = _spec_data(args.file, None, cfg.max_tasks_per_job)
    doc = _front(cfg, args).job_submit(data, wait_s=_wait_s(args), where=f"{args.file}: ")
    _verdict(doc, args)
    _print(doc, args.json, doc["job"])
    return 0


def cmd_job_list(cfg: Config, args) -> int:
    rows = _front(cfg, args).jobs(args.entitlement)
    _print(rows, args.json or args.output == "json", job_table(rows, args.output == "wide"))
    return 0


JOB_COLUMNS = ["JOB", "STATE", "RUNNING", "TASKS", "LAST-REASON"]
# `job list -o wide`: the columns a user looks for next (kubectl's wide: more of the same row), the last reason last
JOB_WIDE = (("ENTITLEMENT", lambda v, now: v["entitlement"]),
            ("SPEC", lambda v, now: f"v{v['spec_version']}" + (f" (incarnation {v['incarnation']})"
                                                               if v.get("incarnation", 1) != 1 else "")),
            ("MACHINES", lambda v, now: len({t["machine"] for t in v["tasks"] if t["machine"]})),
            ("DCS", lambda v, now: ",".join(sorted({t["dc"] for t in v["tasks"] if t["dc"]})) or "-"),
            ("UPDATED", lambda v, now: human_time(v.get("updated_ms"), now)))


def job_table(rows: list[dict], wide: bool = False, now_ms: int | None = None) -> str:
    """`job list` (``wide``: with JOB_WIDE's columns before the last reason)."""
    if not wide:
        return _table(JOB_COLUMNS, [_job_row(v) for v in rows], "no jobs")
    head = [*JOB_COLUMNS[:-1], *(name for name, _ in JOB_WIDE), JOB_COLUMNS[-1]]
    return _table(head, [[*_job_row(v)[:-1], *(cell(v, now_ms) for _, cell in JOB_WIDE), _job_row(v)[-1]]
                         for v in rows], "no jobs")


def _job_row(v: dict) -> list:
    running = sum(t["state"] == "RUNNING" for t in v["tasks"])
    return [v["job"], v["state"], f"{running}/{v['desired_tasks']}", _task_counts(v), v["last_reason"] or ""]


def _job_line(v: dict) -> str:
    """`watch jobs`: a job in one line (its tasks counted once, by state)."""
    return (f"{v['job']:28} {v['state']:9} tasks: {_task_counts(v)}"
            + (f"  {v['last_reason']}" if v["last_reason"] else ""))


def cmd_job_update(cfg: Config, args) -> int:
    from processors.frontend.service import entitlement_of_job

    front = _front(cfg, args)
    data, payload = _spec_data(args.file, entitlement_of_job(args.job), cfg.max_tasks_per_job)
    if payload["job_id"] != args.job:
        raise CliError(f"{args.file}: name: the spec names job {payload['job_id']!r}, not {args.job!r}")
    doc = front.job_update(args.job, data, wait_s=_wait_s(args) if args.wait else None, where=f"{args.file}: ")
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} v{doc['spec_version']}")
    return 0


def cmd_job_resize(cfg: Config, args) -> int:
    from processors import rules

    if (problem := rules.task_count(args.tasks, cfg.max_tasks_per_job, "N", low=0)) is not None:
        raise CliError(str(problem))
    doc = _front(cfg, args).job_resize(args.job, args.tasks, wait_s=_wait_s(args) if args.wait else None, field="N")
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} -> {args.tasks} tasks")
    return 0


def cmd_job_stop(cfg: Config, args) -> int:
    doc = _front(cfg, args).job_stop(args.job, args.reason, wait_s=_wait_s(args) if args.wait else None)
    _verdict(doc, args)
    _print(doc, args.json, f"{args.job} stopping")
    return 0


def cmd_machine_fail(cfg: Config, args) -> int:
    front = _front(cfg, args)
    if getattr(args, "dry_run", False):
        from processors.history import whatif

        doc = front.machine_action(args.machine, args.action, dry_run=True)
        _print(doc, args.json, whatif.text(doc))
        return 0
    doc = front.machine_action(args.machine, args.action)
    verb = "failed" if args.action == "fail" else "recovered"
    _print(doc, args.json, f"{args.machine} {verb}" if doc["event_ids"] else
           f"{args.machine}: nothing to do (already {'down' if args.action == 'fail' else 'up'})")
    return 0


def cmd_machine_power(cfg: Config, args) -> int:
    """`machine power-loss` / `power-restore` of a DC, an MSB or a rack (processors/resourcebroker: power_lost,
    power_restored): what a power controller announces. The tasks there are gone at once and move (paced by the
    scheduler's limiter); power back, the machines boot and the tasks restart (paced too)."""
    action = POWER_ACTIONS[args.action]
    doc = front_power(cfg, args, action)
    what = args.dc or args.msb or args.rack
    if not doc["machines"]:
        text = f"{what}: nothing to do ({'every machine there is down already' if action == 'loss' else 'no machine there is down for a power loss'})"
    elif action == "loss":
        text = (f"{what}: power lost on {len(doc['machines'])} machines (UnavailabilityStarted POWER "
                f"{', '.join(doc['unavailability_ids'])}); their tasks are gone and move")
    else:
        text = (f"{what}: power back on {len(doc['machines'])} machines; their tasks restart, paced by the "
                f"scheduler's limiter")
    _print(doc, args.json, text)
    return 0


POWER_ACTIONS = {"power-loss": "loss", "power-restore": "restore"}


def front_power(cfg: Config, args, action: str) -> dict:
    return _front(cfg, args).machine_power(action, dc=args.dc, msb=args.msb, rack=args.rack)


def add_machine_power(mach) -> None:
    """The parsers of `machine power-loss` and `machine power-restore`."""
    for name, help_ in (("power-loss", "a DC, MSB or rack lost its power: its machines DOWN and an UnavailabilityStarted "
                                       "POWER (its tasks are gone at once and move)"),
                        ("power-restore", "power is back in a DC, MSB or rack: its machines down for a power loss UP "
                                          "again, the POWER unavailability ended (the tasks restart, paced)")):
        sp = user_command(mach.add_parser(name, help=help_, description=help_))
        sp.set_defaults(fn=cmd_machine_power)
        where = sp.add_mutually_exclusive_group(required=True)
        where.add_argument("--dc", metavar="DC")
        where.add_argument("--msb", metavar="DC/MSB")
        where.add_argument("--rack", metavar="DC/MSB/RACK")
        sp.add_argument("--json", action="store_true")


def cmd_machine_list(cfg: Config, args) -> int:
    """`machine list`: the latest state of every machine, from state.machines (published by the allocator)."""
    rows = _front(cfg, args).machines(args.entitlement, args.free, at=args.at)
    wide = args.output == "wide"
    head = ["MACHINE", "STATUS", "OWNER", "DC/MSB/RACK", "TYPE", "FREE-CPU(m)", "FREE-MEM(MiB)", "TASKS", "MAINTENANCE",
            "PROFILE"]
    table = [[r["id"], r["status"], r["entitlement"] or "free", f"{r['dc']}/{r['msb']}/{r['rack']}", r["type"],
              f"{r['free']['cpu_millicores']}/{r['capacity']['cpu_millicores']}",
              f"{r['free']['memory_mib']}/{r['capacity']['memory_mib']}",
              ",".join(r["tasks"]) if wide else len(r["tasks"]), ",".join(r["maintenance"]) or "-",
              _profile_text(r) or "-"] for r in rows]
    empty = "no machines at that moment" if args.at else "no machines (none published on state.machines yet)"
    _print(rows, args.json or args.output == "json", _table(head, table, empty))
    return 0


def cmd_maintenance_list(cfg: Config, args) -> int:
    """`maintenance list`: every maintenance that machines are under now, with its machines (from their views)."""
    from collections import defaultdict

    by_id: dict[str, list[dict]] = defaultdict(list)
    for r in _front(cfg, args).machines(None, False):
        for ue in r["maintenance"]:
            by_id[ue].append(r)
    rows = [{"unavailability_id": ue, "machines": sorted(m["id"] for m in ms),
             "statuses": {s: sum(m["status"] == s for m in ms) for s in sorted({m["status"] for m in ms})}}
            for ue, ms in sorted(by_id.items())]
    wide = args.output == "wide"
    if wide:  # when, from the log's UnavailabilityStarted (the machines' views name only the id)
        windows = {w["unavailability_id"]: w for w in _front(cfg, args).maintenance_windows()}
        rows = [{**r, **{k: windows.get(r["unavailability_id"], {}).get(k) for k in MAINTENANCE_WHEN}} for r in rows]
    _print(rows, args.json or args.output == "json", maintenance_table(rows, wide))
    return 0


MAINTENANCE_WHEN = ("start_ms", "deadline_ms", "expected_duration_ms", "reason")


def maintenance_table(rows: list[dict], wide: bool = False, now_ms: int | None = None) -> str:
    """`maintenance list` (``wide``: when it starts, its deadline, how long, why, and every machine)."""
    head = ["MAINTENANCE", "MACHINES", "STATUSES"]
    cells = [[r["unavailability_id"], len(r["machines"]), ", ".join(f"{s} {n}" for s, n in r["statuses"].items())]
             for r in rows]
    if not wide:
        return _table([*head, "FIRST-MACHINES"],
                      [[*c, ",".join(r["machines"][:3]) + (" ..." if len(r["machines"]) > 3 else "")]
                       for c, r in zip(cells, rows)], "no maintenance planned or under way")
    return _table([*head, "START", "DEADLINE", "DURATION", "REASON", "MACHINE-IDS"],
                  [[*c, human_time(r.get("start_ms"), now_ms), human_time(r.get("deadline_ms"), now_ms),
                    f"{r['expected_duration_ms'] // 60_000}m" if r.get("expected_duration_ms") else "-",
                    r.get("reason") or "-", ",".join(r["machines"])] for c, r in zip(cells, rows)],
                  "no maintenance planned or under way")


def _profile_text(r: dict) -> str:
    """`machine list`: the host profile, when the machine has or wants one other than the default."""
    have, want, st = r["host_profile"] or "", r["host_profile_wanted"], r["host_profile_state"]
    if not have and not want:
        return ""
    return f"{have or 'default'}" + (f" ({st} {want or 'default'})" if st and st != "applied" else "")


def cmd_watch(cfg: Config, args) -> int:  # noqa: C901
    """Current state of everything first, then each change, until interrupted (or --once). A line starts with the
    time of the state record; a record that changes nothing shown (a job republished with the same states) is not
    printed again."""
    last: dict[str, str] = {}  # what was shown of each job / machine

    def emit(v: dict) -> None:
        key = v.get("job") or v.get("id")
        body, seen = show(v), show({k: x for k, x in v.items() if k not in ("updated_ms", "version")})
        if last.get(key) == seen:
            return  # nothing a reader of this line would see has changed (only the record's time or version)
        last[key] = seen
        if args.json:
            print(body, flush=True)
        else:
            from datetime import datetime, timezone

            at = datetime.fromtimestamp(v.get("updated_ms", time.time() * 1000) / 1000, timezone.utc)
            print(f"{at.strftime('%Y-%m-%d %H:%M:%SZ')}  {body}", flush=True)  # the tables' UTC form

    def show(v: dict) -> str:
        if args.kind == "jobs":
            if args.json:
                return json.dumps({k: x for k, x in v.items() if k != "deleted"}, sort_keys=True)
            return _job_line(v) + ("  (deleted)" if v.get("deleted") else "")
        if args.json:
            return json.dumps({"id": v["id"], "status": v["status"], "entitlement": v["entitlement"],
                               **{k: v[k] for k in ("dc", "msb", "rack")}, "type": v["type"],
                               "maintenance": v["maintenance"]}, sort_keys=True)
        return (f"{v['id']:28} {v['status']:11} {v['entitlement'] or 'free':14} {v['type']}"
                + (f"  maintenance {','.join(v['maintenance'])}" if v["maintenance"] else ""))

    front = _front(cfg, args)
    if not direct(args):  # the API's server-sent events: the current state, `ready`, then each change
        for event, data in front.events(args.kind, args.entitlement):
            if event == "ready":
                if args.once:
                    return 0
                continue
            emit(data)
        return 0
    from processors.frontend.service import state_view

    reader = front.state_reader(args.kind, args.entitlement)
    try:
        for ev in sorted(reader.catch_up().values(), key=lambda e: e.entity_id):
            emit(state_view(args.kind, ev))
        if args.once:
            return 0
        for rec in reader.follow():
            emit(state_view(args.kind, rec.event))
    finally:
        reader.close()
    return 0


# --- replay -------------------------------------------------------------------------------------
def cmd_replay(cfg: Config, args) -> int:
    from streams import replay as rp

    since, until = _parse_time(args.since), _parse_time(args.until)
    types, exclude = _types(args.type), _types(args.exclude_type)
    out = sys.stdout
    front = _front(cfg, args)
    # One timeline: the matched events of every topic and partition merged by their time (rp.time_order_key).
    # Progress on a terminal only: off one, stderr keeps its one summary line (console.Progress).
    with Progress(lines=False) as progress:
        if not direct(args):
            run = front.replay(entitlement=args.entitlement, job=args.job, machine=args.machine, since_ms=since,
                               until_ms=until, topic=args.topic, type=types, exclude_type=exclude)
            found = []
            progress("the API reads the log; matched events received", 0)  # counted as they come (no total)
            for item in run:
                found.append(item)
                if len(found) % 500 == 0:
                    progress("the API reads the log; matched events received", len(found))
            matched, read, elapsed = (run.stats.get(k, 0) for k in ("matched", "read", "elapsed_s"))
        else:
            try:
                flt = rp.ReplayFilter(entitlement=args.entitlement, job=args.job, machine=args.machine,
                                      since_ms=since, until_ms=until, topics=tuple(args.topic) if args.topic else None,
                                      types=frozenset(types) if types else None,
                                      exclude_types=frozenset(exclude) if exclude else None)
            except ValueError as exc:
                raise CliError(str(exc)) from None
            run = front.replay(flt, progress=progress)
            found = [(line, json.loads(line)) for line in (rp.format_json(rec) for rec in run)]
            matched, read, elapsed = run.stats.matched, run.stats.read, run.stats.elapsed_s
    found.sort(key=lambda ld: rp.time_order_key(ld[1]))
    for line, doc in found:
        out.write((line if args.json else rp.format_text_doc(doc)) + "\n")
    if not args.json:
        print(f"-- {matched} events matched of {read} read in {elapsed:.2f}s", file=sys.stderr)
    return 0


def _types(values: list[str] | None) -> list[str] | None:
    """``--type A,B --type C`` → [A, B, C]."""
    return [t for v in values for t in v.split(",") if t] if values else None


# --- rebuild ------------------------------------------------------------------------------------
def cmd_rebuild(cfg: Config, args) -> int:
    from processors import controlplane
    from processors.allocator.rebuild import rebuild_index

    _require_broker(cfg)
    pids = {n: p for n in controlplane.allocator_names(cfg) if (p := controlplane.worker_pid(cfg, n)) is not None}
    pid = ", ".join(map(str, pids.values())) if pids else None
    allocator = {"running": bool(pids), "pid": pid}
    if allocator["running"] and not args.force:
        raise CliError(f"an allocator is running ({', '.join(f'{n} pid {p}' for n, p in pids.items())}); stop it first (`ropewalk down`, then `ropewalk up "
                       f"--machines 0` for the broker and Redis alone; `ropewalk up` after the rebuild), or pass "
                       f"--force (a running allocator also rewrites an index it finds emptied)")
    with Progress() as progress:
        st = rebuild_index(cfg, _registry(), progress=progress)
    lines = [f"rebuilt the allocator's Redis index from {st['events']} events ({st['index_events']} applied) in "
             f"{st['seconds']:.2f}s ({st['events_per_s']:,.0f} events/s): {st['keys']} keys swapped in, "
             f"{st['replaced']} replaced"]
    if st["skipped"]:
        lines.append(f"{st['skipped']} undecodable records skipped (the allocator dead-letters them too)")
    if st["failed"]:
        lines.append(f"{st['failed']} events could not be applied and were skipped, as the allocator does: "
                     + "; ".join(st["errors"]))
    lines.append("start the allocator again (`ropewalk up`) if you stopped it for the rebuild"
                 if not allocator["running"] else "warning: the allocator was running (--force): stop it and rebuild "
                                                  "again unless it was idle")
    _print(st, args.json, "\n".join(lines))
    return 0


# --- archive / restore --------------------------------------------------------------------------
def cmd_archive(cfg: Config, args) -> int:
    from streams import archive as ar

    _require_broker(cfg)
    with Progress() as progress:
        st = ar.archive(cfg, Path(args.dir), progress=progress)
    _print(_asdict(st), args.json, f"archived {st.records} records to {args.dir} in {st.seconds:.2f}s "
           f"({st.records_per_s:,.0f} records/s)")
    return 0


def cmd_restore(cfg: Config, args) -> int:
    """Disaster recovery: the archive back into the (embedded or configured) broker, the consumer groups'
    offsets, then the allocator's Redis index rebuilt from the restored log. `ropewalk up` then resumes."""
    from infra import services
    from processors import controlplane
    from processors.allocator.rebuild import rebuild_index
    from streams import archive as ar

    running = [n for n in controlplane.known_workers(cfg) if controlplane.worker_pid(cfg, n) is not None]
    if running:
        raise CliError(f"the control plane is running ({', '.join(running)}); `ropewalk down` first: restored "
                       f"processors must start from the restored positions")
    with Progress() as progress:
        progress("starting the broker and Redis")
        services.up(cfg)
        st = ar.restore(cfg, Path(args.dir), force=args.force, progress=progress)
        index = rebuild_index(cfg, _registry(), progress=lambda what, done=None, total=None: progress(
            f"rebuilding the allocator's index: {what}", done, total))
    doc = {**_asdict(st), "index": index}
    lines = [f"restored {st.records} records from {args.dir} in {st.seconds:.2f}s ({st.records_per_s:,.0f} records/s); "
             f"offsets of {len(st.groups)} consumer groups committed ({', '.join(sorted(st.groups)) or 'none archived'})",
             f"rebuilt the allocator's index from the restored log: {index['index_events']} events, "
             f"{index['machines']} machines, in {index['seconds']:.2f}s"]
    if st.offsets_moved:
        lines.append(f"offsets differ from the archived ones in {len(st.offsets_moved)} partitions (holes in the "
                     f"archived log; group offsets were translated): {', '.join(st.offsets_moved[:5])}"
                     f"{' ...' if len(st.offsets_moved) > 5 else ''}")
    lines.append("next    ropewalk up   (the processors resume where the archived ones were)")
    _print(doc, args.json, "\n".join(lines))
    return 0


def _asdict(obj) -> dict:
    from dataclasses import asdict, is_dataclass

    return asdict(obj) if is_dataclass(obj) else dict(obj)


# --- schemas / topics ---------------------------------------------------------------------------
def cmd_schemas(cfg: Config, args) -> int:
    if args.action == "check":
        from streams import compat

        return compat.main([str(Path(__file__).resolve().parents[2] / "schemas")])
    registry = _registry()
    doc = [{"event": s.name, "topic": s.topic, "version": s.version, "fingerprint": s.fingerprint_hex}
           for s in (registry.reader(n) for n in registry.event_names)]
    _print(doc, args.json, "\n".join(f"{d['event']:30} {d['topic']:15} v{d['version']}  {d['fingerprint']}" for d in doc))
    return 0


def cmd_topics(cfg: Config, args) -> int:
    from streams.topics import CATALOGUE

    t = _topics(cfg)
    doc = [{"topic": t.name(s.name), "partitions": t.partitions_of(s.name), "key": s.key,
            "copartitioned": s.copartitioned, "config": dict(s.config), "events": list(s.events), "doc": s.doc}
           for s in CATALOGUE]
    _print(doc, args.json, "\n".join(f"{d['topic']:20} {d['partitions']:>3}p  key={d['key']:12} {d['doc']}" for d in doc))
    return 0


# --- maintenance (Ops Planner) and experiments ---------------------------------------------------
def _when_ms(value: str, now_ms: int) -> int:
    """An absolute time (ms since epoch, ISO-8601) or ``+DURATION`` from now."""
    return now_ms + _duration_ms(value[1:]) if value.startswith("+") else _parse_time(value)


def cmd_maintenance(cfg: Config, args) -> int:
    """`maintenance plan`: UnavailabilityStarted(MAINTENANCE) with advance notice and deadline for the machines of
    the region concerned; `maintenance end UE`: the window is over (tasks stopped for it start again)."""
    front = _front(cfg, args)
    now = int(time.time() * 1000)
    if args.action == "end":
        doc = front.maintenance_end(args.unavailability_id)
        _print(doc, args.json, f"maintenance {args.unavailability_id} ended: {len(doc['machines'])} machines")
        return 0
    plan = dict(start_ms=_when_ms(args.start, now), duration_ms=_duration_ms(args.duration),
                deadline_ms=None if args.deadline is None else _when_ms(args.deadline, now),
                machines=[m for m in args.machines.split(",") if m] if args.machines else None,
                rack=args.rack, msb=args.msb, reason=args.reason)
    if args.dry_run:
        from processors.history import whatif

        doc = front.maintenance_plan(**plan, dry_run=True)
        _print(doc, args.json, whatif.text(doc))
        return 0
    doc = front.maintenance_plan(**plan)
    _print(doc, args.json, f"maintenance {doc['unavailability_id']} planned: {len(doc['machines'])} machines, start "
                           f"{human_time(doc['start_ms'], now)}, deadline {human_time(doc['deadline_ms'], now)}, "
                           f"lasting {_ago(doc['expected_duration_ms']).removeprefix('in ')}")
    return 0


def cmd_rebalance(cfg: Config, args) -> int:
    """`rebalance plan`: the ReBalancer's latest plan per entitlement (or every plan) and each move's progress;
    with --dry-run, the plan the log calls for now, produced nowhere (processors/rebalancer/)."""
    from processors.rebalancer import queries as rb
    from processors.rebalancer.solver import goals_of

    if args.dry_run:  # the solver runs here, on the caller's CPU, over the whole region's log: not the API's work
        if not direct(args):
            raise CliError("rebalance plan --dry-run folds the log and solves here, as the operator: add --direct")
        _require_broker(cfg)
        try:
            views = rb.dry_run(cfg, _registry(), goals_of(args), args.entitlement)
        except ValueError as exc:
            raise CliError(f"rebalance plan --dry-run: {exc}") from None
    else:
        views = _front(cfg, args).rebalance_plans(args.entitlement, args.all)
    _print(views, args.json, rb.format_views(views) or "no plans yet (the ReBalancer found nothing to move)")
    return 0


# --- users of the API ---------------------------------------------------------------------------------------------
def cmd_user(cfg: Config, args) -> int:
    """The API's users file (<secrets>/users.yaml): add (prints the token once), grant, revoke, remove, list."""
    from processors.api import users as u

    path = cfg.secrets / u.USERS_FILE
    try:
        if args.action == "add":
            roles = dict(_role(r) for r in args.role or ())
            token = u.add_user(path, args.name, roles, args.region_admin)
            _print({"user": args.name, "token": token, "roles": roles, "region_admin": args.region_admin}, args.json,
                   token)
            return 0
        if args.action == "grant":
            u.grant(path, args.name, *_role(f"{args.entitlement}={args.role}"))
        elif args.action == "revoke":
            u.grant(path, args.name, args.entitlement, None)
        elif args.action == "remove":
            u.remove_user(path, args.name)
        users = u.load(path).by_name
    except u.UsersError as exc:
        raise CliError(str(exc)) from None
    rows = [{"user": n, "region_admin": x.region_admin, "roles": dict(x.roles)} for n, x in sorted(users.items())]
    _print(rows, args.json, _table(["USER", "REGION-ADMIN", "ROLES"],
                                   [[r["user"], "yes" if r["region_admin"] else "no",
                                     " ".join(f"{e}={role}" for e, role in sorted(r["roles"].items())) or "-"]
                                    for r in rows], "no users"))
    return 0


def _role(text: str) -> tuple[str, str]:
    from processors.api.authz import ROLES
    from processors import rules

    ent, _, role = text.partition("=")
    if rules.name_problem(ent, "entitlement", "") is not None or role not in ROLES:
        raise CliError(f"--role: expected ENTITLEMENT=ROLE with a role of {', '.join(ROLES)}, got {text!r}")
    return ent, role


# --- bench, experiment: the bench package's programs --------------------------------------------
BENCH_COMMANDS = ("bench", "experiment")


def exec_bench(argv: list[str]):
    """``bench ...`` and ``experiment ...`` are bench/'s (bench/cli.py: their flags and handlers, on this parser):
    this process becomes ``python -P -m bench.cli ARGV``, so a signal sent to it (Ctrl-C, ``kill``) reaches the bench
    (which stops the region it started), and its output and exit code are the bench's. Nothing outside bench/
    imports bench/ (tests/unit/test_layers.py). ``-P``: the working directory is not put on sys.path, so a
    ``bench/`` there is not the one run (the installed package is). Does not return."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-P", "-m", "bench.cli", *argv])


# --- parser -------------------------------------------------------------------------------------
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ropewalk")
    except PackageNotFoundError:
        return "unknown (not installed)"

EXAMPLES = """examples (the README's "Using it" has more):
  ropewalk up                                   # a local region: broker, Redis, 200 simulated machines, the API
  ropewalk status                               # every worker and topic
  ropewalk entitlement create e1 --quota 4
  ropewalk job submit examples/web.yaml         # prints the job id, e1.web
  ropewalk job status e1.web -o wide            # its tasks: machine, version, age, restarts, moves
  ropewalk job describe e1.web                  # + its last refusals and recent events
  ropewalk job logs demo.hello -f               # a task's output as it is written
  ropewalk machine fail dc1-msb2-r02-m001 --dry-run   # what would move where
  ropewalk replay --job e1.web --since now-10m  # its events, in time order
  ropewalk at now-15m                           # the whole region 15 minutes ago
  ropewalk <command> --help                     # a command's flags and examples
"""
SUBCOMMAND_EXAMPLES = {  # a command's examples under its --help
    "machine": "examples:\n  ropewalk machine list --entitlement e1\n  ropewalk machine list -o wide\n"
               "  ropewalk machine fail dc1-msb2-r02-m001 --dry-run\n  ropewalk machine recover dc1-msb2-r02-m001",
    "replay": "examples:\n  ropewalk replay --entitlement e1 --since 10m\n  ropewalk replay --job e1.web --since now-1h "
              "--exclude-type TaskStatesChanged\n  ropewalk replay --machine dc1-msb2-r02-m001 --json",
    "maintenance": "examples:\n  ropewalk maintenance plan --msb dc1/msb2 --start +15m --duration 30m --deadline +10m\n"
                   "  ropewalk maintenance list -o wide\n  ropewalk maintenance end ID",
    "up": "examples:\n  ropewalk up                      # 200 simulated machines and the demo job\n"
          "  ropewalk up --machines 0 --no-demo   # the broker, Redis and topics alone",
}


def _with_examples(p: argparse.ArgumentParser) -> None:
    """Give the commands of SUBCOMMAND_EXAMPLES their examples (an epilog kept as written)."""
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    for name, text in SUBCOMMAND_EXAMPLES.items():
        sp = sub.choices[name]
        sp.epilog, sp.formatter_class = text, argparse.RawDescriptionHelpFormatter


DRY_RUN_HELP = "say what would happen (tasks moved, stopped, waiting; controllers asked; capacity left); produce nothing"


def build_parser(bench_commands=None) -> argparse.ArgumentParser:
    """The CLI's parser. ``bench_commands(bench, experiment)``: gives those two commands their flags and handlers
    (bench/cli.add_commands; without it they are names in the help, and ``main`` hands them to bench/cli.py)."""
    p = argparse.ArgumentParser(prog="ropewalk", description="Ropewalk: a Twine-style cluster manager on a Kafka log",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"ropewalk {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    cmd = functools.partial(command, sub)

    sp = cmd("up", cmd_up, "start the broker and Redis (unless external ones are configured) and provision topics")
    sp.add_argument("--machines", type=int, default=200,
                    help="simulated machines of the local region (0: infrastructure and topics only)")
    sp.add_argument("--no-demo", action="store_true",
                    help="do not create the demo entitlement and job (demo.hello on the process agent)")
    sp.add_argument("--brokers", type=int, default=None,
                    help="nodes of the embedded Kafka cluster: 1, or 3 and more (each topic replicated 3 times, "
                         "min.insync.replicas 2); default: the cluster the run directory holds, else 1 "
                         "(ROPEWALK_BROKERS)")
    sp.add_argument("--schedulers", type=int, metavar="N",
                    help="scheduler shards, each its own process (scheduler-0..N-1), splitting the partitions; a "
                         "later `up` with another N adds or stops shards (default: as many as run, else 1)")
    sp.add_argument("--allocators", type=int, metavar="M",
                    help="allocators, each its own process (allocator-0..M-1), splitting the allocations "
                         "partitions (default: as many as run, else 1)")
    sp = cmd("down", cmd_down, "stop everything `up` started (the supervisor, every worker, Redis, the broker); the "
             "process agent stops its tasks (started again at the next `up`)")
    sp.add_argument("--keep-tasks", action="store_true",
                    help="leave the process agent's tasks running; the next `up` adopts them")
    sp.add_argument("--forget", action="store_true",
                    help="also forget the endpoints the last `up` remembered (<run dir>/endpoints.json): a new shell "
                         "uses the defaults or its ROPEWALK_* variables")
    cmd("status", cmd_status, "components, endpoints, every expected worker (state, restarts) and topic sizes; "
        "exits 1 when one is down")
    sp = cmd("produce", cmd_produce, "validate JSON against an event's schema, fill the envelope, produce it")
    sp.add_argument("topic")
    sp.add_argument("event_type")
    sp.add_argument("file", help="JSON file (one object, an array, or JSON Lines), or - for stdin")
    sp.add_argument("--entitlement", help="envelope.entitlement (the partition key) when the JSON has none")
    ent = sub.add_parser("entitlement", help="entitlements: quota as a pseudo-cluster").add_subparsers(dest="action", required=True)
    sp = user_command(ent.add_parser("create", help="create an entitlement (region admin)"))
    sp.set_defaults(fn=cmd_entitlement_create)
    sp.add_argument("name")
    sp.add_argument("--quota", type=int, required=True, help="machines the entitlement may hold")
    sp.add_argument("--host-profile")
    sp.add_argument("--machine-type")
    sp.add_argument("--dc", help="pin the entitlement to one data center")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("update", help="change an entitlement (a quota: region admin; else its owner)"))
    sp.set_defaults(fn=cmd_entitlement_update)
    sp.add_argument("name")
    sp.add_argument("--quota", type=int)
    sp.add_argument("--host-profile")
    sp.add_argument("--machine-type")
    sp.add_argument("--dc")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser(
        "move", help="move an entitlement to another partition (another scheduler shard), its jobs running on "
                     "(region admin); waits until it lives there"))
    sp.set_defaults(fn=cmd_entitlement_move)
    sp.add_argument("name")
    sp.add_argument("--partition", type=int, required=True, help="the partition it is to live on")
    sp.add_argument("--reason", default="", help="why (kept on the log)")
    sp.add_argument("--no-wait", action="store_true", help="return once the request is on the log")
    sp.add_argument("--wait-s", type=float, default=60.0, help="how long to wait for it to arrive (default 60)")
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("list", help="the entitlements you may see"))
    sp.set_defaults(fn=cmd_entitlement_list)
    sp.add_argument("--json", action="store_true")
    sp = user_command(ent.add_parser("get", help="one entitlement: quota, machine type, DC pin, host profile"))
    sp.set_defaults(fn=cmd_entitlement_list)
    sp.add_argument("name")
    sp.add_argument("--json", action="store_true")
    job = sub.add_parser("job", help="submit, inspect and change jobs").add_subparsers(dest="action", required=True)
    for name, fn, help_, extra in (
        ("submit", cmd_job_submit, "submit a job spec (YAML or JSON); prints the job id once the scheduler accepted "
                                   "it (through the API: a refusal fails with its reason)", ("file",)),
        ("update", cmd_job_update, "replace a job's spec (rolling update)", ("job", "file")),
        ("stop", cmd_job_stop, "stop a job and free its tasks", ("job",)),
    ):
        sp = user_command(job.add_parser(name, help=help_, description=help_), intent=True)
        sp.set_defaults(fn=fn)
        for a in extra:
            sp.add_argument(a)
        sp.add_argument("--json", action="store_true")
        if name == "stop":
            sp.add_argument("--reason", default="")
    from processors.frontend.commands import jobs  # status, describe, logs (processors/frontend/commands/jobs.py)

    jobs.add_commands(job)
    sp = user_command(job.add_parser("list", help="the jobs you may see: state, tasks running"))
    sp.set_defaults(fn=cmd_job_list)
    sp.add_argument("--entitlement")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: also entitlement, spec version, machines, DCs, when updated; json: as --json")
    sp = user_command(job.add_parser("resize", help="change a job's task count"), intent=True)
    sp.set_defaults(fn=cmd_job_resize)
    sp.add_argument("job")
    sp.add_argument("tasks", type=int, metavar="N")
    sp.add_argument("--json", action="store_true")
    mach = sub.add_parser("machine", help="operator actions on machines").add_subparsers(dest="action", required=True)
    for name, help_ in (("fail", "mark a machine DOWN (its tasks move elsewhere)"), ("recover", "mark a machine UP again")):
        sp = user_command(mach.add_parser(name, help=help_, description=help_))
        sp.set_defaults(fn=cmd_machine_fail)
        sp.add_argument("machine")
        sp.add_argument("--json", action="store_true")
        if name == "fail":
            sp.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    add_machine_power(mach)
    sp = user_command(mach.add_parser("list", help="machines: status, owner, fault domains, free capacity",
                      description="machines: status, owner, fault domains, free capacity (from state.machines)"))
    sp.set_defaults(fn=cmd_machine_list)
    which = sp.add_mutually_exclusive_group()
    which.add_argument("--entitlement", help="only the machines this entitlement holds")
    which.add_argument("--free", action="store_true", help="only the machines in the free pool")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-o", "--output", choices=["wide", "json"], help="wide: every task id; json: as --json")
    sp.add_argument("--at", metavar="TIME", help=AT_HELP)
    sp = user_command(cmd("watch", cmd_watch, "follow a state stream: current state first, then each change"))
    sp.add_argument("kind", choices=["jobs", "machines"])
    sp.add_argument("--entitlement")
    sp.add_argument("--once", action="store_true", help="print the current state and exit")
    sp = user_command(cmd("replay", cmd_replay, "audit timeline from the log (one event per line)",
             json_help="print one JSON object per event, one per line (envelope, payload, topic, partition, offset)"))
    for flag in ("entitlement", "job", "machine"):
        sp.add_argument(f"--{flag}")
    sp.add_argument("--since", help="a duration ago (10m, 1h, 2d), ISO-8601 or ms since epoch; inclusive")
    sp.add_argument("--until", help="same forms as --since; exclusive")
    sp.add_argument("--topic", action="append", help="logical topic to read (repeatable); default all")
    sp.add_argument("--type", action="append", metavar="EVENT[,EVENT]", help="only these event types (repeatable)")
    sp.add_argument("--exclude-type", action="append", metavar="EVENT[,EVENT]",
                    help="leave these event types out (repeatable), e.g. --exclude-type TaskStatesChanged")
    sp = cmd("rebuild", cmd_rebuild, "rebuild every Redis index from the log and swap it in atomically; stop the "
             "allocator first (refused while it runs; the swap is refused if it writes to the index meanwhile)")
    sp.add_argument("--force", action="store_true",
                    help="rebuild although the allocator's pid file shows it running (the swap is still refused "
                         "if it writes to the index meanwhile)")
    sp = cmd("archive", cmd_archive, "write every topic to Avro container files (incremental, resumable)")
    sp.add_argument("dir", nargs="?", default="archive")
    sp = cmd("restore", cmd_restore, "disaster recovery: an archive back into an empty broker (log, consumer "
             "offsets, changelogs), then the Redis index rebuilt; `up` resumes")
    sp.add_argument("dir", nargs="?", default="archive")
    sp.add_argument("--force", action="store_true", help="restore even if topics already hold records")
    sp = cmd("schemas", cmd_schemas, "list event schemas, or check they stay compatible with their git history")
    sp.add_argument("action", choices=["list", "check"], nargs="?", default="list")
    cmd("topics", cmd_topics, "the topic catalogue as configured")
    bench = cmd("bench", None, "benchmark the whole pipeline on a region of its own (own ports and run dir); "
                "prints every figure with its conditions", json_flag=False)  # flags and handler: bench/cli.py
    mnt = sub.add_parser("maintenance", help="Ops Planner: planned maintenance with advance notice and deadline"
                         ).add_subparsers(dest="action", required=True)
    sp = user_command(mnt.add_parser("plan", help="announce maintenance of machines, a rack or an MSB",
                      description="UnavailabilityStarted(MAINTENANCE) for the machines concerned: their jobs' "
                                  "TaskControllers choose per task (move, stop and restart after, keep running); "
                                  "at the deadline the scheduler stops what remains"))
    sp.set_defaults(fn=cmd_maintenance)
    where = sp.add_mutually_exclusive_group(required=True)
    where.add_argument("--machines", help="M1,M2,...")
    where.add_argument("--rack", help="DC/MSB/RACK")
    where.add_argument("--msb", help="DC/MSB")
    sp.add_argument("--start", required=True, help="ms since epoch, ISO-8601, or +DURATION from now (+1h)")
    sp.add_argument("--duration", required=True, help="seconds, or 500ms, 90s, 15m, 2h")
    sp.add_argument("--deadline", help="when what remains is stopped (default: the start); same forms as --start")
    sp.add_argument("--reason", default="maintenance")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    sp = user_command(mnt.add_parser("list", help="maintenance machines are under: its id, machines, their "
                                                  "statuses"))
    sp.set_defaults(fn=cmd_maintenance_list)
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    sp.add_argument("-o", "--output", choices=["wide", "json"],
                    help="wide: also start, deadline, duration, reason and every machine; json: as --json")
    sp = user_command(mnt.add_parser("end", help="the maintenance is over: machines back UP, tasks stopped for it "
                                                 "start again"))
    sp.set_defaults(fn=cmd_maintenance)
    sp.add_argument("unavailability_id")
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    reb = sub.add_parser("rebalance", help="the ReBalancer's plans of moves").add_subparsers(dest="action",
                                                                                           required=True)
    sp = user_command(reb.add_parser(
        "plan", help="the latest plan per entitlement and each move's progress",
        description="The ReBalancer's plans (RebalancePlanned on intents): goals, constraints, balance before and "
                    "after, and every move with its progress (done, elsewhere, moving, waiting). --dry-run (with "
                    "--direct): the plan the log calls for now, produced nowhere"))
    sp.set_defaults(fn=cmd_rebalance)
    sp.add_argument("--entitlement", help="only this entitlement")
    sp.add_argument("--all", action="store_true", help="every plan, not only the latest per entitlement")
    sp.add_argument("--dry-run", action="store_true", help="plan now from the log, here (needs --direct); produce "
                    "nothing")
    from processors.rebalancer.solver import goals_arguments

    goals_arguments(sp)
    sp.add_argument("--json", action="store_true", help="print one JSON document")
    usr = sub.add_parser("user", help="the API's users: tokens, roles per entitlement, region admin "
                         "(<secrets>/users.yaml)").add_subparsers(dest="action", required=True)
    sp = usr.add_parser("add", help="add a user; prints its token (shown once: only its hash is kept)")
    sp.add_argument("name")
    sp.add_argument("--role", action="append", metavar="ENTITLEMENT=ROLE",
                    help="viewer, operator or owner of an entitlement (repeatable)")
    sp.add_argument("--region-admin", action="store_true", help="may do everything (quotas, machines, maintenance)")
    for name, help_, extra in (("grant", "give a user a role on an entitlement", ("name", "entitlement", "role")),
                               ("revoke", "take a user's role on an entitlement away", ("name", "entitlement")),
                               ("remove", "remove a user (its token stops working)", ("name",)),
                               ("list", "users and their roles", ())):
        sp2 = usr.add_parser(name, help=help_)
        for a in extra:
            sp2.add_argument(a)
        sp2.add_argument("--json", action="store_true")
        sp2.set_defaults(fn=cmd_user)
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(fn=cmd_user)
    # the history (processors/history): the region at any moment, shadow replay, what-if, explain
    from processors.frontend.commands import history

    history.add_commands(sub, reparse=build_parser)
    from processors.frontend.commands import keys  # the keys behind the identities on the log (infra/trust.py)

    keys.add_commands(sub)
    experiment = sub.add_parser("experiment", help="reproduce the Twine paper's experiments")  # bench/cli.py's
    add_upper_floors(sub)
    if bench_commands is not None:
        bench_commands(bench, experiment)
    _with_examples(p)
    return p


def add_upper_floors(sub) -> None:
    """The commands of the Job Control Plane (`intents`), the autoscaler (`srm`) and elastic loans (`loans`), each
    in its own module of processors/frontend/commands/ (its parser beside its handlers)."""
    from processors.frontend.commands import intents, loans, srm

    for commands in (intents, srm, loans):
        commands.add_commands(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from infra.private import private_umask

    private_umask()  # what the CLI writes (the run directory, archives) is its user's alone (infra/private.py)
    if argv[:1] and argv[0] in BENCH_COMMANDS:
        exec_bench(argv)
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    """Parse ``argv`` and run its command: a failure is one line with its reason (exit 1), an interrupt exits 130."""
    from streams.deadletter import Skipped

    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, with its usage (not the top level's: `job status X -o wide`)
        _deepest(parser, argv).error(f"unrecognized arguments: {' '.join(extra)}")
    args.skipped = Skipped()  # what the command's readers could not decode: said once, when it ends
    failed = False
    try:
        cfg = Config.from_env().with_(kafka_log_level=0)  # this one line says what failed (Config.kafka_log_level)
        return args.fn(cfg, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - every failure is one line with a reason, never a traceback
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        skipped = args.skipped.report()  # on the same line: it may be why (a job whose only state was unreadable)
        print(f"ropewalk: {msg}" + (f" ({skipped})" if skipped else ""), file=sys.stderr)
        failed = True
        return 1
    finally:
        if not failed and (line := args.skipped.report()) is not None:
            print(f"ropewalk: {line}", file=sys.stderr)


def _deepest(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``argv`` names: ``job status`` → the `job status` parser."""
    current = parser
    for token in argv:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and token in subs[0].choices:
            current = subs[0].choices[token]
    return current


if __name__ == "__main__":
    sys.exit(main())
