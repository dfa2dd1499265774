"""The log's commands: ``produce`` (an event checked against its schema), ``watch`` (a state stream followed),
``replay`` (the audit timeline), ``rebuild`` (the Redis index from the log), ``archive`` and ``restore``, ``schemas``
and ``topics``; their parser beside their handlers. ``watch`` and ``replay`` are the user's (through the API unless
``--direct``); the others are the operator's and act on the log directly.

The imports inside the handlers are start-up cost: ``ropewalk --help`` does not load the broker's client, the
replay, the archive or the allocator's rebuild.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from pathlib import Path

from infra.config import Config
from processors.frontend.console import CliError, Progress, _front, _parse_time, _read, _registry, \
    _require_broker, command, direct, user_command
from processors.frontend.render import _job_line, _print
from processors.frontend.service import state_view
from streams.topics import CATALOGUE, Topics


def add_produce(sub) -> None:
    """``produce`` under the CLI's subcommands ``sub`` (registered before the entitlements, as it always was)."""
    cmd = functools.partial(command, sub)
    sp = cmd("produce", cmd_produce, "validate JSON against an event's schema, fill the envelope, produce it")
    sp.add_argument("topic")
    sp.add_argument("event_type")
    sp.add_argument("file", help="JSON file (one object, an array, or JSON Lines), or - for stdin")
    sp.add_argument("--entitlement", help="envelope.entitlement (the partition key) when the JSON has none")


def add_commands(sub) -> None:
    """``watch``, ``replay``, ``rebuild``, ``archive``, ``restore``, ``schemas`` and ``topics`` under ``sub``."""
    cmd = functools.partial(command, sub)
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
    sp.add_argument("--from-log", action="store_true",
                    help="fold the log from its beginning, not from the newest snapshot of the allocator's fold "
                         "(<run dir>/allocator/)")
    sp = cmd("archive", cmd_archive, "write every topic to Avro container files (incremental, resumable)")
    sp.add_argument("dir", nargs="?", default="archive")
    sp = cmd("restore", cmd_restore, "disaster recovery: an archive back into an empty broker (log, consumer "
             "offsets, changelogs), then the Redis index rebuilt; `up` resumes")
    sp.add_argument("dir", nargs="?", default="archive")
    sp.add_argument("--force", action="store_true", help="restore even if topics already hold records")
    sp = cmd("schemas", cmd_schemas, "list event schemas, or check they stay compatible with their git history")
    sp.add_argument("action", choices=["list", "check"], nargs="?", default="list")
    cmd("topics", cmd_topics, "the topic catalogue as configured")


def cmd_produce(cfg: Config, args) -> int:
    from processors.frontend.produce import build_event, parse_documents  # start-up (the module's docstring)
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


def cmd_watch(cfg: Config, args) -> int:
    """Current state of everything first, then each change, until interrupted (or --once). A line starts with the
    time of the state record; a record that changes nothing shown (a job republished with the same states) is not
    printed again."""
    last: dict[str, str] = {}  # what was shown of each job / machine

    def emit(v: dict) -> None:
        _emit(v, args.kind, args.json, last)

    front = _front(cfg, args)
    if not direct(args):  # the API's server-sent events: the current state, `ready`, then each change
        for event, data in front.events(args.kind, args.entitlement):
            if event == "ready":
                if args.once:
                    return 0
                continue
            emit(data)
        return 0
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


def _emit(v: dict, kind: str, as_json: bool, last: dict[str, str]) -> None:
    """`watch`'s line of ``v``, unless nothing a reader of it would see changed since ``last`` (what was shown of
    each job / machine; only the record's time or version changed)."""
    key = v.get("job") or v.get("id")
    body, seen = _watch_text(v, kind, as_json), _watch_text({k: x for k, x in v.items()
                                                             if k not in ("updated_ms", "version")}, kind, as_json)
    if last.get(key) == seen:
        return
    last[key] = seen
    if as_json:
        print(body, flush=True)
    else:
        at = datetime.fromtimestamp(v.get("updated_ms", time.time() * 1000) / 1000, timezone.utc)
        print(f"{at.strftime('%Y-%m-%d %H:%M:%SZ')}  {body}", flush=True)  # the tables' UTC form


def _watch_text(v: dict, kind: str, as_json: bool) -> str:
    if kind == "jobs":
        if as_json:
            return json.dumps({k: x for k, x in v.items() if k != "deleted"}, sort_keys=True)
        return _job_line(v) + ("  (deleted)" if v.get("deleted") else "")
    if as_json:
        return json.dumps({"id": v["id"], "status": v["status"], "entitlement": v["entitlement"],
                           **{k: v[k] for k in ("dc", "msb", "rack")}, "type": v["type"],
                           "maintenance": v["maintenance"]}, sort_keys=True)
    return (f"{v['id']:28} {v['status']:11} {v['entitlement'] or 'free':14} {v['type']}"
            + (f"  maintenance {','.join(v['maintenance'])}" if v["maintenance"] else ""))


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
        st = rebuild_index(cfg, _registry(), progress=progress, from_snapshot=not args.from_log)
    start = (f"the snapshot {st['snapshot']} (the fold of {st['snapshot_records']} records) and "
             if st["snapshot"] else "")
    lines = [f"rebuilt the allocator's Redis index from {start}{st['events']} events read ({st['index_events']} "
             f"applied) in {st['seconds']:.2f}s ({st['log_events_per_s']:,.0f} events/s of the log): {st['keys']} "
             f"keys swapped in, {st['replaced']} replaced"]
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
            f"rebuilding the allocator's index: {what}", done, total), from_snapshot=False)  # the restored log
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
    return asdict(obj) if is_dataclass(obj) else dict(obj)


def cmd_schemas(cfg: Config, args) -> int:
    if args.action == "check":
        from streams import compat

        return compat.main([str(Path(__file__).resolve().parents[3] / "schemas")])
    registry = _registry()
    doc = [{"event": s.name, "topic": s.topic, "version": s.version, "fingerprint": s.fingerprint_hex}
           for s in (registry.reader(n) for n in registry.event_names)]
    _print(doc, args.json, "\n".join(f"{d['event']:30} {d['topic']:15} v{d['version']}  {d['fingerprint']}" for d in doc))
    return 0


def cmd_topics(cfg: Config, args) -> int:
    t = Topics(cfg.topic_prefix, cfg.partitions)
    doc = [{"topic": t.name(s.name), "partitions": t.partitions_of(s.name), "key": s.key,
            "copartitioned": s.copartitioned, "config": dict(s.config), "events": list(s.events), "doc": s.doc}
           for s in CATALOGUE]
    _print(doc, args.json, "\n".join(f"{d['topic']:20} {d['partitions']:>3}p  key={d['key']:12} {d['doc']}" for d in doc))
    return 0
