"""The region's commands: ``up`` (the broker, Redis, topics, ACLs, the control plane and the demo job), ``down``,
``status``; their parser beside their handlers. The operator's: they always act directly, never through the API.

The imports inside the handlers are start-up cost: ``ropewalk --help`` does not load the broker's client
(confluent_kafka), the services, the supervisor or the control plane.
"""
from __future__ import annotations

import functools
import os
import sys
import time

from infra.config import Config, check_brokers, forget_endpoints, held_brokers, remember_endpoints, \
    remembered_endpoints, remembered_from
from infra.credentials import write_principal_files
from processors.frontend.console import CliError, Progress, command
from processors.frontend.demo import DEMO_ENTITLEMENT, DEMO_JOB, DEMO_WAIT_S, _start_demo
from processors.frontend.render import _print, _table
from streams.topics import CATALOGUE, Topics, provision, replication_factor


def add_commands(sub) -> None:
    """``up``, ``down`` and ``status`` under the CLI's subcommands ``sub``."""
    cmd = functools.partial(command, sub)
    sp = cmd("up", cmd_up, "start the broker and Redis (unless external ones are configured) and provision topics")
    sp.add_argument("--machines", type=int, metavar="N",
                    help="simulated machines of the local region (0: infrastructure and topics only; default: as "
                         "many as the run directory's region holds, else 200)")
    sp.add_argument("--no-demo", action="store_true",
                    help="do not create the demo entitlement and job (demo.hello on the process agent); they are made "
                         "only in a region that holds no job, and waited for where they are")
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


def cmd_up(cfg: Config, args) -> int:
    t0 = time.monotonic()
    with Progress() as step:  # each step on stderr as it goes (processors/frontend/console.py)
        return _up(cfg, args, t0, step)


def _up(cfg: Config, args, t0: float, step: Progress) -> int:
    from infra import acls, services  # start-up (the module's docstring), as every import inside a handler here
    from processors import controlplane

    cfg = _with_brokers(cfg, args.brokers)
    args.machines = _machines(controlplane.held_machines(cfg), args.machines)
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
    demo = None
    if args.machines > 0 and region["ready"] and not args.no_demo:
        demo = _start_demo(cfg, args.skipped,
                           say=lambda made: step(f"{'starting' if made else 'waiting for'} the demo job "
                                                 f"{DEMO_ENTITLEMENT}.{DEMO_JOB} (at most {DEMO_WAIT_S:.0f} s)"))
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


def _machines(held: int | None, asked: int | None) -> int:
    """`up --machines N`; without it, ``held``: the simulated machines of the region the run directory holds (after
    `down` or a power loss: the region that ran, not a new one of another size), else ``DEFAULT_MACHINES``."""
    from processors import controlplane

    if asked is None:
        return controlplane.DEFAULT_MACHINES if held is None else held
    if asked < 0:
        raise CliError(f"--machines: expected 0 or more, got {asked}")
    return asked


def _with_brokers(cfg: Config, brokers: int | None) -> Config:
    """`up --brokers N` (or ROPEWALK_BROKERS): the embedded cluster of N nodes; neither: the cluster the run directory
    holds (infra/config.held_brokers), else one node. Remembered with the endpoints, for `status` and `down` in
    another shell. (A run directory holding another number of nodes is refused when the broker starts.)"""
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


def cmd_down(cfg: Config, args) -> int:
    from infra import services
    from processors import controlplane

    if args.keep_tasks:
        controlplane.keep_tasks(cfg)
    st = services.down(cfg)
    lines = [f"{k}: {'stopped' if v.get('stopped') else 'was not running'}" for k, v in st.items()]
    if args.forget:
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
        held = [n for n, w in programs.items() if w["state"] == supervisor.HELD]
        print(f"ropewalk: not running: {', '.join(down)}"
              + ("; held since a cold start: `ropewalk up` starts them" if held else ""), file=sys.stderr)
    return 0 if all(s["ready"] for s in st.values()) and not down else 1


def _topic_offsets(cfg: Config) -> dict[str, dict]:
    """Per topic, summed over its partitions: ``end_offsets`` (the high watermarks: the offset the next record
    gets), ``start_offsets`` (the low watermarks: where the log starts now) and ``records`` (end - start: the records
    the topic holds; for a compacted topic at most that many, as the cleaner removes a key's older records without
    moving the start), and whether it is ``compacted``."""
    from confluent_kafka import Consumer, TopicPartition

    from infra.acls import reader_group
    from streams.retry import watermark_offsets

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


def _topics(cfg: Config):
    return Topics(cfg.topic_prefix, cfg.partitions)


def _admin(cfg: Config):
    from confluent_kafka.admin import AdminClient

    return AdminClient({**cfg.kafka_conf(), "log_level": 0})
