"""The allocator's machine index in Redis: the materialized view of its in-memory fold, and the commit point.

The allocator decides on its in-memory fold of the log (fold.py). Redis holds what other readers and other
allocator processes use: every machine with its tasks, every placement, the entitlements, how far the log was
folded, the decisions committed but maybe not yet on the log, and the partitions' fences. The writes:

* ``project`` — after each batch the fold applied, the machines it changed, in pipelined Lua calls of
  ``PROJECT_CHUNK`` machines: a machine is written only if the fold's version is newer than Redis's (another
  allocator, or this one's own commit, may have written it already), its task set made equal to the fold's,
  its placements moved with it, and it is queued in the outbox for ``state.machines``. Plus the applied marks
  (never lowered) and the entitlements.
* ``commit`` — a batch of decisions in ONE call, each all or nothing and re-checked machine by machine against
  Redis (the optimistic check where several allocators could race; Nomad's plan_apply): the decision's frees,
  then for each machine of its plan the status, owner, capacity, version and that no task is placed already,
  and, when the plan adds free machines to the entitlement, that the machines it then holds stay within its quota
  (``held:<e>``: two allocators may decide for one entitlement at once); then the placements, each machine's version bumped by the kinds of change, and the decision's events kept
  under ``alloc:done:<request event id>`` (``DONE_TTL_S``) until they are surely on the log. A request whose
  done entry exists is answered from it; a decision whose partition's fence moved is refused (``FENCED``).

Keys (under the prefix; ``<m>`` a machine, ``<t>`` a task, ``<e>`` an entitlement, ``<p>`` a partition)::

    m:<m>               hash   region dc msb rack type cpu_cap mem_cap cpu_free mem_free entitlement ("" = free
                               pool) status host_profile ("" = default) version maintenance (planned maintenance
                               ids joined by ",", "" = none; absent in a hash written before it existed)
    tasks:<m>           set    tasks placed on the machine
    placement           hash   task -> machine              taskres   hash   task -> "cpu mem"
    entitlement:<e>     hash   quota_machines machine_type dc_pin host_profile ("" = none)
    held:<e>            set    the machines the entitlement holds (any status): what the commit checks its quota
                               against; kept by the commit and the projection wherever a machine's owner changes
    applied:<consumer>  hash   "topic/partition" -> the last offset the projected fold applied
    outbox:machines     hash   machine -> "version cause": changed, state not yet published to state.machines
    alloc:done:<r>      string a committed decision's events (JSON), until DONE_TTL_S after the commit
    alloc:fence:<p>     string the fence of an ``allocations`` partition: raised by each new owner
    metrics:allocator   hash   requests decided (and placements, rejections)
    index:generation    string names the index since it was last written whole (``claim_generation``): a Redis
                               emptied (FLUSHALL, a redis-server started again without its data) has none, and a
                               commit under another generation is refused (``IndexLost``): the allocator projects
                               its fold again before it decides (processors/allocator/README.md)
    index:summary       hash   machines: how many the fold holds, and per status how many have it (``summary``:
                               what ``ropewalk up`` waits on, without reading every machine)
    index:format        string the index's layout (``FORMAT``), written with every whole projection: an allocator
                               that finds an older one (an index written before ``held:<e>`` existed) writes its
                               fold whole at start

About 0.5 KB per machine (measured by ``ropewalk bench``; the index sets, free-capacity zset, epochs and request
hashes of the Redis-first index are gone: the fold answers those questions in memory).
"""
from __future__ import annotations

import json
import uuid
from collections import defaultdict
from itertools import chain
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import hiredis
import orjson
import redis

from processors.allocator import lua
from processors.allocator.fold import CONFLICT_TASK_PLACED, RegionFold, split_maintenance
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_QUOTA, CONFLICT_STATUS, CONFLICT_VERSION, Machine,
)
from streams.enums import MachineStatus
from streams.topics import FREE_POOL_OWNER

DEFAULT_CONSUMER = "allocator"
FIELDS = ("region", "dc", "msb", "rack", "type", "cpu_cap", "mem_cap", "cpu_free", "mem_free", "entitlement",
          "status", "host_profile", "version", "maintenance")
OUTBOX = "outbox:machines"
PROJECT_CHUNK = 500  # machines per projection call (one call holds the server a few milliseconds)
BULK_CHUNK = 5_000  # machines per pipeline round of ``write_whole``, and entries per shared hash or set command
DONE_TTL_S = 3600  # a committed decision's events are kept this long (it reaches the log within seconds)
DONE_TTL_ENV = "ROPEWALK_ALLOC_JOURNAL_TTL_S"  # another (the soak's simulated hour: bench/experiments/soak.py)
# Commit outcomes (beside "ok").
JOURNALED = "journaled"  # the decision was committed before (a crash before its events were produced)
FENCED = "fenced"  # the request's partition has a new owner: this allocator must not decide it
CONFLICT = "conflict"
GENERATION = "index:generation"
SUMMARY = "index:summary"  # hash: machines, and per status the machines with it (written with each projection)
HELD = "held:"  # + entitlement: set of the machines it holds (the commit's quota check)
FORMAT_KEY = "index:format"
FORMAT = "2"  # 2: with HELD sets. An index of another format is written whole by the next allocator to start
LOST = "lost"  # the commit's reply when the index is not the generation the allocator projected into


class FunctionsMissing(RuntimeError):
    """Redis does not hold the index's read functions and this client may not load them (a reader): the allocator
    loads them at its start and whenever it writes the index whole (``MachineIndex.load_functions``)."""


class IndexLost(RuntimeError):
    """Redis no longer holds the index this allocator projected (emptied, or another generation): nothing was
    committed; the allocator projects its fold again (a new generation) before it decides."""


# The Redis scripts (processors/allocator/lua/*.lua, each with its ARGV and reply documented at its top), preceded
# by the key prefix (ARGV[1]) and these constants (lua.script).
_CONSTANTS = {"FIELDS": FIELDS, "GENERATION": GENERATION, "LOST": LOST, "HELD": HELD}

_LUA_PROJECT = lua.script("project", **_CONSTANTS)
_LUA_COMMIT = lua.script("commit", **_CONSTANTS)
_LUA_OUTBOX_DONE = lua.script("outbox_done")
_READ_CHUNK = 1000  # machines a read call takes at most (the library's MAX_READ)
# The readers' functions (FCALL_RO): the one thing a Redis user of the readers may run against the index
# (infra/credentials.py, REDIS_RULES), each bounded work whatever its arguments (processors/allocator/lua).
LIBRARY = "ropewalk_index"
READ, SUMMARY_OF = "ropewalk_read", "ropewalk_summary"
_LUA_LIBRARY = lua.library(LIBRARY, {READ: "read", SUMMARY_OF: "summary"},
                           FIELDS=FIELDS, SUMMARY=SUMMARY, MAX_READ=_READ_CHUNK)

_COMMIT_REASONS = json.dumps({"up": MachineStatus.UP, "status": CONFLICT_STATUS, "owner": CONFLICT_OWNER,
                              "capacity": CONFLICT_CAPACITY, "version": CONFLICT_VERSION,
                              "task_placed": CONFLICT_TASK_PLACED, "quota": CONFLICT_QUOTA})


@dataclass(frozen=True)
class Decision:
    """What the commit writes for one decided request (see ``_LUA_COMMIT``)."""

    request_event_id: str
    partition: int
    fence: int | None  # None: not fenced (a test, or a tool deciding outside the consumer group)
    entitlement: str
    cpu: int
    mem: int
    frees: tuple[tuple[str, str], ...]  # (task, machine) freed first
    released: tuple[str, ...]  # machines going back to the free pool
    plan: tuple[tuple[str, int, bool, tuple[str, ...]], ...]  # (machine, expected version, added, tasks)
    events: str  # the decision's events, JSON (processor.dump_events)
    quota: int | None = None  # the machines its entitlement may hold, checked when the plan adds some (None: not)

    def to_json(self) -> dict:
        return {"rid": self.request_event_id, "part": self.partition, "fence": self.fence, "ent": self.entitlement,
                "cpu": self.cpu, "mem": self.mem, "frees": [list(f) for f in self.frees],
                "released": list(self.released),
                "plan": [[m, v, int(a), list(ts)] for m, v, a, ts in self.plan], "events": self.events,
                "quota": self.quota}


@dataclass(frozen=True)
class Committed:
    outcome: str  # "ok", JOURNALED, FENCED or CONFLICT
    versions: Mapping[str, int] = field(default_factory=dict)  # ok: machine -> its version after the commit
    conflicts: Mapping[str, str] = field(default_factory=dict)  # CONFLICT: machine -> CONFLICT_*
    events: str | None = None  # JOURNALED: the decision committed before
    held: tuple[str, ...] = ()  # CONFLICT_QUOTA: the machines the entitlement holds in Redis (the loser reloads them)


def text(v: Any) -> Any:
    """A Redis reply's bytes as text (the index's clients read raw bytes: bulk replies parse faster that way)."""
    return v.decode() if isinstance(v, bytes) else v



def _to_machine(mid: str, v: Sequence[Any]) -> Machine:
    f = dict(zip(FIELDS, map(text, v)))
    return Machine(id=mid, dc=f["dc"], msb=f["msb"], rack=f["rack"], machine_type=f["type"],
                   cpu_free=int(f["cpu_free"]), mem_free=int(f["mem_free"]), cpu_capacity=int(f["cpu_cap"]),
                   mem_capacity=int(f["mem_cap"]), entitlement=f["entitlement"] or None, status=f["status"],
                   version=int(f["version"]), maintenance=split_maintenance(f["maintenance"]))


class _Bulk:
    """Commands packed by hiredis and sent ``BULK_CHUNK`` at a time on one connection, every reply read (an error
    reply raised): ``MachineIndex.write_whole``. The keys written are added to ``keys``."""

    def __init__(self, r: redis.Redis, keys: list[str] | None) -> None:
        self.r, self.keys = r, keys
        self._seen: set[str] = set(keys or ())
        self.commands: list[tuple] = []

    def add(self, command: tuple) -> None:
        self.commands.append(command)
        if self.keys is not None and command[1] not in self._seen:  # once: the shared hashes come in rounds
            self._seen.add(command[1])
            self.keys.append(command[1])
        if len(self.commands) >= BULK_CHUNK:
            self.flush()

    def hset(self, key: str, mapping: Mapping[str, Any]) -> None:
        if mapping:
            self.add(("HSET", key, *chain.from_iterable(mapping.items())))

    def hset_all(self, mappings: Mapping[str, dict[str, Any]]) -> None:
        """Each mapping into its key, then emptied."""
        for key, mapping in mappings.items():
            self.hset(key, mapping)
            mapping.clear()

    def flush(self) -> None:
        if not self.commands:
            return
        conn = self.r.connection_pool.get_connection()
        try:
            conn.send_packed_command([b"".join(map(hiredis.pack_command, self.commands))])
            errors = [reply for reply in (conn.read_response(disable_decoding=True) for _ in self.commands)
                      if isinstance(reply, Exception)]
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            self.r.connection_pool.release(conn)
        self.commands = []
        if errors:
            raise errors[0]


class MachineIndex:
    """The machine index under ``prefix`` in ``redis_client``; ``consumer`` names its applied marks."""

    def __init__(self, redis_client, prefix: str, consumer: str = DEFAULT_CONSUMER, *,
                 done_ttl_s: int = DONE_TTL_S) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.consumer = consumer
        self.done_ttl_s = done_ttl_s  # the journal's: how long a committed decision's events are kept
        self.generation: str | None = None  # commits are refused unless the index is of this one (None: unchecked)
        self._project = redis_client.register_script(_LUA_PROJECT)
        self._commit = redis_client.register_script(_LUA_COMMIT)
        self._outbox_done = redis_client.register_script(_LUA_OUTBOX_DONE)

    def key(self, name: str) -> str:
        return self.prefix + name

    # --- the readers' functions ---------------------------------------------------------------------------
    def load_functions(self) -> None:
        """Load (or replace) the index's function library: the allocator and the operator may; a reader may not."""
        self.r.function_load(_LUA_LIBRARY, replace=True)

    def _fcall(self, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``calls`` ((function, args)) as FCALL_RO in one pipeline; the library loaded first if Redis lacks it
        (``FunctionsMissing`` when this client may not load it)."""
        for attempt in (1, 2):
            pipe = self.r.pipeline(transaction=False)
            for fn, args in calls:
                pipe.fcall_ro(fn, 0, *args)
            try:
                return pipe.execute() if calls else []
            except redis.ResponseError as exc:
                if "function not found" not in str(exc).lower() or attempt == 2:
                    raise
            try:
                self.load_functions()
            except redis.exceptions.NoPermissionError:
                raise FunctionsMissing(f"Redis holds no {LIBRARY} functions, and this client may not load them: the "
                                       f"allocator loads them at its start") from None
        raise AssertionError("unreachable")

    # --- writing the fold ---------------------------------------------------------------------------------
    def project(self, fold: RegionFold, changed: Mapping[str, str], *, marks: bool = True,
                entitlements: Iterable[str] = ()) -> int:
        """Write the fold's state of the ``changed`` machines (id -> cause), its applied marks and the named
        entitlements; pipelined, ``PROJECT_CHUNK`` machines per call. Returns the machines written."""
        rows = []
        for mid, cause in changed.items():
            m = fold.machines.get(mid)
            if m is None:
                continue
            rows.append([mid, m.fields(), [[t, *fold.taskres[t]] for t in sorted(m.tasks)], cause or ""])
        mark_rows = {f"{t}/{p}": o for (t, p), o in fold.marks.items()} if marks else {}
        ents = {name: {k: ("" if v is None else v) for k, v in fold.entitlement_fields[name].items()}
                for name in entitlements if name in fold.entitlement_fields}
        pipe = self.r.pipeline(transaction=False)
        calls = 0
        for i in range(0, len(rows), PROJECT_CHUNK):
            self._project(args=[self.prefix, orjson.dumps(rows[i:i + PROJECT_CHUNK]), "{}",
                                "{}", self.consumer], client=pipe)
            calls += 1
        if mark_rows or ents or not calls:
            self._project(args=[self.prefix, "[]", orjson.dumps(mark_rows) if mark_rows else "{}",
                                orjson.dumps(ents) if ents else "{}", self.consumer], client=pipe)
        if rows:  # what the fold holds, by status, after this projection (``summary``)
            pipe.delete(self.key(SUMMARY))
            pipe.hset(self.key(SUMMARY), mapping=fold.summary())
        return sum(int(n) for n in pipe.execute()[:calls + int(bool(mark_rows or ents or not calls))])

    def summary(self) -> dict[str, int] | None:
        """How many machines the index holds, by status (``UP``, ``DOWN``, ...), as the last projection left them:
        one small read, where counting the machines' hashes reads them all (seconds at 1,000,000 machines).
        None when no projection wrote it (an index written before it existed)."""
        flat = self._fcall([(SUMMARY_OF, [self.prefix])])[0]
        raw = {text(k): int(v) for k, v in zip(flat[::2], flat[1::2])}
        if not raw:
            return None
        raw.pop("machines", None)
        return raw

    def project_all(self, fold: RegionFold) -> int:
        """The whole fold: every machine, mark and entitlement (a Redis that lost or lags the index), in this
        layout (``FORMAT``)."""
        self.load_functions()  # a Redis that lost the index may have lost its functions too (readers need them)
        n = self.project(fold, {mid: "" for mid in fold.machines}, entitlements=fold.entitlement_fields)
        if fold.machines or fold.entitlement_fields:  # (an empty index has no layout to name)
            self.r.set(self.key(FORMAT_KEY), FORMAT)
        return n

    def write_whole(self, fold: RegionFold, keys: list[str] | None = None) -> int:
        """The whole fold into an EMPTY prefix (a rebuild's scratch keys), as ``project_all`` writes it, key for key
        (tests/integration/test_rebuild.py compares them), without the projection's version checks: plain writes, a
        command per machine and chunks of the shared hashes and sets, each round of ``BULK_CHUNK`` packed by hiredis
        and sent as one (redis-py's pipeline spent 1.5 s of 3.9 packing 100,000 machines' commands in Python, and the
        projection's Lua is Redis's own time: 1.8 s either way; stop 43). Returns the machines written; the keys
        written are added to ``keys`` (the swap renames them without scanning for them)."""
        self.load_functions()
        k = self.key
        out = _Bulk(self.r, keys)
        placement: dict[str, str] = {}
        taskres: dict[str, str] = {}
        outbox: dict[str, str] = {}
        held: dict[str, list[str]] = defaultdict(list)
        for mid, m in fold.machines.items():
            out.hset(k(f"m:{mid}"), m.fields())
            if m.tasks:
                tasks = sorted(m.tasks)
                out.add(("SADD", k(f"tasks:{mid}"), *tasks))
                placement.update((t, mid) for t in tasks)
                taskres.update((t, "{} {}".format(*fold.taskres[t])) for t in tasks)
            outbox[mid] = f"{m.version} "  # as the projection queues a machine with no cause
            if m.entitlement != FREE_POOL_OWNER:
                held[m.entitlement].append(mid)
            if len(outbox) >= BULK_CHUNK:
                out.hset_all({k("placement"): placement, k("taskres"): taskres, k(OUTBOX): outbox})
        out.hset_all({k("placement"): placement, k("taskres"): taskres, k(OUTBOX): outbox})
        for ent, mids in held.items():
            for i in range(0, len(mids), BULK_CHUNK):
                out.add(("SADD", k(HELD + ent), *mids[i:i + BULK_CHUNK]))
        self._write_small(out, fold)
        out.flush()
        return len(fold.machines)

    def _write_small(self, out: "_Bulk", fold: RegionFold) -> None:
        """``write_whole``'s marks, entitlements, summary and format."""
        k = self.key
        if fold.marks:
            out.hset(k(f"applied:{self.consumer}"), {f"{t}/{p}": o for (t, p), o in fold.marks.items()})
        for name, fields in fold.entitlement_fields.items():
            out.hset(k(f"entitlement:{name}"), {f: "" if v is None else v for f, v in fields.items()})
        if fold.machines:
            out.hset(k(SUMMARY), fold.summary())
        if fold.machines or fold.entitlement_fields:
            out.add(("SET", k(FORMAT_KEY), FORMAT))

    def format(self) -> str | None:
        """The layout the index was last written whole in (``FORMAT``); None: before the layout was named."""
        return text(self.r.get(self.key(FORMAT_KEY)))

    def marks(self) -> dict[tuple[str, int], int]:
        out = {}
        for f, o in self.r.hgetall(self.key(f"applied:{self.consumer}")).items():
            topic, _, part = text(f).rpartition("/")
            out[(topic, int(part))] = int(o)
        return out

    # --- the commit ---------------------------------------------------------------------------------------
    def commit(self, decisions: Sequence[Decision]) -> list[Committed]:
        """Commit a batch of decisions in one call (see the module doc); one result per decision, in order."""
        if not decisions:
            return []
        raw = self._commit(args=[self.prefix, orjson.dumps([d.to_json() for d in decisions]),
                                 self.done_ttl_s, _COMMIT_REASONS, self.generation or ""])
        if text(raw) == LOST:
            raise IndexLost(f"the index is not generation {self.generation} any more "
                            f"(now {self.read_generation()}): nothing committed")
        out = []
        for reply in raw:
            outcome = text(reply[0])
            if outcome == "ok":
                flat = reply[1]
                out.append(Committed("ok", versions=MappingProxyType(
                    {text(m): int(v) for m, v in zip(flat[::2], flat[1::2])})))
            elif outcome == JOURNALED:
                out.append(Committed(JOURNALED, events=text(reply[1])))
            elif outcome == FENCED:
                out.append(Committed(FENCED))
            else:
                flat = reply[1]
                out.append(Committed(CONFLICT, conflicts=MappingProxyType(
                    {text(m): text(r) for m, r in zip(flat[::2], flat[1::2])}),
                    held=tuple(sorted(map(text, reply[2])))))
        return out

    # --- the generation -----------------------------------------------------------------------------------
    def read_generation(self) -> str | None:
        return text(self.r.get(self.key(GENERATION)))

    def claim_generation(self) -> str:
        """Name the index as now written whole: a new generation unless it has one (another allocator, or a rebuild,
        wrote it whole first); commits are checked against it from now on. Returns it."""
        self.r.set(self.key(GENERATION), uuid.uuid4().hex, nx=True)
        self.generation = generation = self.read_generation()
        if generation is None:  # deleted between the two calls (a FLUSHALL): claimed by nobody
            raise IndexLost("the index's generation was deleted while it was named")
        return generation

    def lost(self, projected_marks: Mapping[tuple[str, int], int]) -> str | None:
        """Why Redis no longer holds what was projected into it (its generation is another, or none; its applied
        marks are behind ``projected_marks``, what this allocator last wrote: a redis-server started again without
        its last writes), or None. One round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.key(GENERATION))
        pipe.hgetall(self.key(f"applied:{self.consumer}"))
        gen, raw = pipe.execute()
        if text(gen) != self.generation:
            return f"its generation is {text(gen)}, not {self.generation}"
        marks = {(t, int(p)): int(o) for f, o in raw.items() for t, _, p in [text(f).rpartition("/")]}
        behind = sorted(f"{t}/{p}" for (t, p), o in projected_marks.items() if marks.get((t, p), -1) < o)
        return f"its applied marks are behind what was projected ({', '.join(behind[:4])})" if behind else None

    def journaled(self, request_event_ids: Sequence[str]) -> dict[str, str]:
        """The journaled decisions (events as JSON) of these requests that are still kept (``DONE_TTL_S``)."""
        if not request_event_ids:
            return {}
        raw = self.r.mget([self.key(f"alloc:done:{rid}") for rid in request_event_ids])
        return {rid: text(v) for rid, v in zip(request_event_ids, raw) if v is not None}

    def fence(self, partitions: Iterable[int]) -> dict[int, int]:
        """Raise the fence of each ``allocations`` partition (a new owner): decisions made under an older
        fence are refused from now on. Returns the new fences."""
        parts = sorted(set(partitions))
        pipe = self.r.pipeline(transaction=False)
        for p in parts:
            pipe.incr(self.key(f"alloc:fence:{p}"))
        return dict(zip(parts, map(int, pipe.execute()))) if parts else {}

    def reload(self, machine_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The machines as Redis holds them: fields (ints where numeric) plus ``tasks``: {task: (cpu, mem)}."""
        ids = sorted(set(machine_ids))
        pipe = self.r.pipeline(transaction=True)
        for mid in ids:
            pipe.hgetall(self.key(f"m:{mid}"))
            pipe.smembers(self.key(f"tasks:{mid}"))
        res = pipe.execute() if ids else []
        out: dict[str, dict[str, Any]] = {}
        all_tasks: list[str] = []
        for mid, fields, tasks in zip(ids, res[::2], res[1::2]):
            if not fields:
                continue
            f = {text(a): text(v) for a, v in fields.items()}
            for n in ("cpu_cap", "mem_cap", "cpu_free", "mem_free", "version"):
                f[n] = int(f[n])
            f["maintenance"] = split_maintenance(f.get("maintenance"))
            f["tasks"] = sorted(map(text, tasks))
            all_tasks += f["tasks"]
            out[mid] = f
        res = self.r.hmget(self.key("taskres"), all_tasks) if all_tasks else []
        taskres = {t: tuple(map(int, text(r).split())) for t, r in zip(all_tasks, res) if r is not None}
        for f in out.values():
            f["tasks"] = {t: taskres.get(t, (0, 0)) for t in f["tasks"]}
        return out

    def add_metrics(self, counts: Mapping[str, int]) -> None:
        if counts:
            pipe = self.r.pipeline(transaction=False)
            for name, n in counts.items():
                pipe.hincrby(self.key("metrics:allocator"), name, n)
            pipe.execute()

    # --- reading ------------------------------------------------------------------------------------------
    def machines(self, ids: Iterable[str]) -> dict[str, Machine]:
        """The machines of ``ids`` that exist, read in pipelined chunks (``READ``, FCALL_RO)."""
        ids = list(ids)
        out = {}
        for blob in self._fcall([(READ, [self.prefix, *ids[i:i + _READ_CHUNK]])
                                 for i in range(0, len(ids), _READ_CHUNK)]):
            for record in filter(None, text(blob).split("\x1e")):
                mid, *values = record.split("\x1f")
                out[mid] = _to_machine(mid, values)
        return out

    def machine(self, machine_id: str) -> Machine | None:
        return self.machines([machine_id]).get(machine_id)

    def machine_ids(self) -> list[str]:
        """Every machine of the index (a SCAN: the allocator's and the operator's; a reader may not scan)."""
        start = len(self.key("m:"))
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "m:*"
        return [text(k)[start:] for k in self.r.scan_iter(match=pattern, count=1000)]

    def placements(self) -> dict[str, str]:
        """task -> machine, every placement in the index."""
        return {text(t): text(m) for t, m in self.r.hgetall(self.key("placement")).items()}

    # --- state.machines: the outbox -----------------------------------------------------------------------
    def outbox(self, limit: int = 1000) -> dict[str, tuple[int, str]]:
        """Up to ``limit`` machines whose state changed and is not published yet: id -> (version, cause)."""
        return self.outbox_from(0, limit)[0]

    def outbox_from(self, cursor: int, limit: int = 1000) -> tuple[dict[str, tuple[int, str]], int]:
        """``outbox`` from where the last read of a drain left its HSCAN (``cursor``; 0: a new pass), and the cursor
        to go on from (0: the pass is over). A drain goes on from the cursor rather than from 0 each time: a scan
        from 0 walks past every bucket emptied by what was published since, so draining a region's registration
        (a million machines in the outbox) took Redis O(n²): ~0.5 of a core for minutes after the region was ready
        (2026-11-29; 300,000 entries drained in 4.9 s from 0, 0.65 s from the cursor). A pass that reaches the end
        from a cursor and finds nothing begins again from 0 (what was queued behind the cursor meanwhile)."""
        out: dict[str, tuple[int, str]] = {}
        began = cursor
        while True:
            cursor, got = self.r.hscan(self.key(OUTBOX), cursor, count=limit)
            for mid, v in got.items():
                version, _, cause = text(v).partition(" ")
                out[text(mid)] = (int(version), cause)
            if cursor == 0 and not out and began != 0:
                began = 0  # the tail of the pass was empty: once more from the start
                continue
            if cursor == 0 or len(out) >= limit:
                return out, int(cursor)

    def states(self, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Every field of the machines of ``ids`` that exist (strings, as stored) plus ``task_ids`` (sorted),
        each machine read in one MULTI so its fields and tasks agree."""
        ids = list(ids)
        pipe = self.r.pipeline(transaction=True)
        for mid in ids:
            pipe.hgetall(self.key(f"m:{mid}"))
            pipe.smembers(self.key(f"tasks:{mid}"))
        res = pipe.execute() if ids else []
        return {mid: {"id": mid, **{text(f): text(v) for f, v in fields.items()}, "task_ids": sorted(map(text, tasks))}
                for mid, fields, tasks in zip(ids, res[::2], res[1::2]) if fields}

    def outbox_done(self, published: Mapping[str, int]) -> int:
        """Remove published machines from the outbox, unless a later change of theirs was queued meanwhile."""
        flat = [x for mid, v in published.items() for x in (mid, int(v))]
        return int(self._outbox_done(keys=[self.key(OUTBOX)], args=flat)) if flat else 0

    # --- whole-index --------------------------------------------------------------------------------------
    def _keys(self) -> list[str]:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"
        return sorted(text(k) for k in self.r.scan_iter(match=pattern, count=1000))

    def dump(self) -> dict[str, Any]:
        """Every key of the index under the prefix (without it) -> its value: hash dict, set sorted list, str. The
        outbox is left out: it is the state publisher's queue, not materialized state."""
        keys = [k for k in self._keys() if not k[len(self.prefix):].startswith("outbox:")]
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.type(k)
        types = [text(t) for t in pipe.execute()]
        read = {"hash": pipe.hgetall, "set": pipe.smembers, "string": pipe.get,
                "zset": lambda k: pipe.zrange(k, 0, -1, withscores=True)}
        for k, t in zip(keys, types):
            read[t](k)
        out: dict[str, Any] = {}
        for k, t, v in zip(keys, types, pipe.execute()):
            name = k[len(self.prefix):]
            if t == "hash":
                out[name] = {text(f): text(x) for f, x in v.items()}
            elif t == "set":
                out[name] = sorted(map(text, v))
            elif t == "zset":
                out[name] = {text(m): s for m, s in v}
            else:
                out[name] = text(v)
        return out

    def clear(self) -> int:
        keys = self._keys()
        for i in range(0, len(keys), 1000):
            self.r.unlink(*keys[i:i + 1000])
        return len(keys)
