"""The allocator's machine index in Redis: materialized from the log, rebuildable, with an optimistic commit.

The index is thin wiring around ``placement`` (pure): it turns machine and allocation events into Redis state,
hands the allocator a snapshot of ``placement.Machine`` s, and commits a ``placement.Plan`` with a
compare-and-set. Every write is one Lua script (EVALSHA), so a state change and what guards it are one
atomic step.

Keys (all under ``prefix``; ``<m>`` a machine id, ``<e>`` an entitlement, ``<t>`` a task id)::

    m:<m>              hash   region dc msb rack type cpu_cap mem_cap cpu_free mem_free
                              entitlement ("" = free pool) status host_profile ("" = default) version
    idx:dc:<dc>        set    machines in a DC              idx:type:<type>   set  machines of a type
    idx:status:<s>     set    machines with a status        dcs               set  DCs seen
    free:<dc>          set    the DC's free pool            ent:<e>           set  machines <e> holds
    z:cpu_free         zset   machine -> free cpu (millicores)
    tasks:<m>          set    tasks placed on <m>
    placement          hash   task -> machine               taskres           hash task -> "cpu mem"
    req:<request_id>   hash   cpu, mem of an AllocationRequested, and t:<t> per task not yet answered
    applied:<consumer> hash   "topic/partition" -> last applied offset
    epoch:<e>          string grows by every version bump of a machine while <e> holds it (the cache's check)
    outbox:machines    hash   machine -> "version cause": changed, state not yet published to state.machines

Empty sets vanish (Redis deletes them), so a key exists only while it holds something.

**The outbox** (``outbox``/``states``/``outbox_done``). Every step that changes a machine (any version bump,
or a new registration) queues it in ``outbox:machines``, in the same script, with the event (or the request,
for a commit) that caused it. The allocator drains it to ``state.machines`` (processor.py): read the machines'
current state, produce, flush, then remove each machine whose queued version is at most the one published.
So a state change is published at least once even if the process dies right after the change, and an event
applied again changes nothing and queues nothing. ``dump()`` leaves the outbox out (it is a queue, not
materialized state); ``epoch:<e>`` is materialized like versions (a rebuild gives the same values).

**Applying events** (``apply``/``apply_many``). One generic script checks the applied mark of the event's
(topic, partition) — an offset at or below it changes nothing (at-least-once redelivery) — then applies the
event and moves the mark, atomically. Every handler is also idempotent by content, so the same fact arriving
twice (redelivered at a new offset, or already written by the allocator's commit) changes nothing:

    MachineRegistered              create the machine in its DC's free pool, status REGISTERED_STATUS;
                                   re-registration updates changed attributes (free capacity follows capacity)
    MachineStatusChanged           set status                      HostProfileApplied    set host_profile
    MachineAssignedToEntitlement   free pool -> <e>, only if the machine is in the free pool; the
                                   allocator's own (an echo) changes nothing: see "Allocator echoes"
    MachineReleasedToFreePool      <e> -> free pool, only if <e> (envelope.entitlement) still holds it and
                                   no task is on it (else the release is stale: <e> took it again)
    AllocationRequested            remember cpu/mem per task of the request in req:<id>
    TasksAllocated                 machines_added join <e> (if free); each task not already placed on its
                                   machine is placed there (subtract req:<id>'s cpu/mem; a task placed
                                   elsewhere is moved); answered tasks leave req:<id>
    AllocationRejected             unplaced tasks leave req:<id>
    TasksDeallocated               each task placed on the named machine is removed (capacity comes back);
                                   machines_released go back to the free pool as for MachineReleasedToFreePool

**Allocator echoes.** The allocator emits one MachineAssignedToEntitlement per machine its commit added, on
``machines``, beside the TasksAllocated (``allocations``) whose ``machines_added`` names the same machines: same
decision, same causation. So the echo carries no fact of its own: live, the commit wrote the assignment
before the echo was produced; in a rebuild, the TasksAllocated makes it (an echo read first and ignored
leaves the TasksAllocated to bump the version by owner + tasks, as the commit did). The echo is therefore
applied as a no-op (only its applied mark moves) when its envelope producer is the allocator
(``ALLOCATOR_PRODUCER``). Applying it by content ("take the machine if it is free") is unsound: ``machines``
and ``allocations`` are read concurrently, so the echo can be read after a later decision of the same
entitlement freed the machine's tasks and released it (TasksDeallocated, applied at once by the allocator);
the machine is free again and the echo would take it back with no task on it, leaking quota until the
release echo is read — for good if the entitlement placed on it meanwhile. No mark or version is needed for
this rule, so it holds however late or however often (a redelivered decision) the echo is read. A
MachineAssignedToEntitlement from any other producer (an operator, a test) is a fact of its own and is
applied by content as above. Release echoes keep the content rule: a stale MachineReleasedToFreePool finds
the machine re-taken with tasks on it and changes nothing (``releasable``).

AllocationRequested/AllocationRejected are applied because TasksAllocated does not carry the tasks'
resources: a rebuild takes them from the request, which precedes its result on the same partition.
An event about a machine the index does not know raises ``UnknownMachine`` and writes nothing (no mark
either): the caller routes it to the dead letters, or a rebuild applied topics in the wrong order.

**Versions.** A machine's ``version`` counts changes: each kind of change one step makes to a machine
(attributes, status, host profile, owner, tasks added, tasks removed) bumps it by one, and a step that
changes nothing does not bump it. So the commit below and the events that record it bump a machine by the
same amount whichever of them writes the fact first, and a rebuild that applies the log's records in the
order the live index read them gives the same keys and values, applied marks included. Another interleaving
of the machines and allocations topics converges on ownership and capacity in the usual cases but can count
versions differently (an entitlement that releases and re-takes a machine, its assign/release echoes read
after the allocations): a rebuild must merge the topics in one fixed order.

**Snapshots** (``snapshot``) take the entitlement's machines plus the free pool, narrowed server-side with
SINTER over the index sets (``idx:dc``, ``idx:type``), and read the machines with a read-only script in
chunks of ``_READ_CHUNK`` (one packed string per chunk). Machines are not all read at one instant; the
commit's per-machine check makes that harmless. Filter rejections in the plan then count only the machines
the snapshot holds; when nothing fits, ``allocate`` re-places over the un-narrowed snapshot to explain why.

**The commit** (``commit``; Nomad ``plan_apply``, Twine §2.3). The allocator plans on a snapshot, then one
script re-checks every machine of the plan, in ``placement.commit_check``'s order: status UP
(CONFLICT_STATUS), owner is the entitlement — or the free pool for ``machines_added`` (CONFLICT_OWNER), free
cpu/mem for all its tasks (CONFLICT_CAPACITY), version equals the snapshot's (CONFLICT_VERSION); and that no
task of the plan is placed already (CONFLICT_TASK_PLACED). **All or nothing per request**: if every machine
passes, the script takes the added machines out of ``free:<dc>`` into ``ent:<e>``, places the tasks,
subtracts capacity and bumps versions; if any fails it writes nothing and returns every conflicting machine
with its reason (partial commit is explicit: the caller sees exactly which machines moved under it).
``allocate`` then re-plans on a fresh snapshot and retries, up to ``max_attempts``. The script also returns
the entitlement's epoch right before and after the commit, so the job-level cache (cache.py) can tell whether
anything but this commit changed the entitlement's machines since it last looked. The commit is the
allocator's authoritative write; the TasksAllocated (and MachineAssignedToEntitlement) events it then emits
find their facts already written and change nothing but the applied mark (the assign echoes by rule, see
"Allocator echoes").

The scripts build key names from the prefix, so the index needs one Redis (or, on a cluster, a prefix with
a hash tag such as ``{region1}:`` so that every key lands on one slot).
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from redis.exceptions import ResponseError

from processors.allocator import placement
from processors.allocator.cache import AllocationCache, build_entry, machines_after, shape_of
from processors.allocator.cache import lookup as cache_lookup
from processors.allocator.placement import (
    CONFLICT_CAPACITY, CONFLICT_OWNER, CONFLICT_STATUS, CONFLICT_VERSION, MACHINE_UP, NO_FEASIBLE_MACHINE,
    Entitlement, Machine, Plan, Request,
)
from streams.events import Event

# Commit-time conflict: a task of the plan is already placed (a duplicate or replayed request).
# Belongs beside the other CONFLICT_* in placement.py; defined here until that module takes it.
CONFLICT_TASK_PLACED = "task_already_placed"
# allocate() gave up: every attempt met a conflict. Also a candidate for placement.py.
COMMIT_RETRIES_EXHAUSTED = "commit_retries_exhausted"

REGISTERED_STATUS = MACHINE_UP  # status of a newly registered machine until a MachineStatusChanged says otherwise
DEFAULT_CONSUMER = "allocator"
# The allocator's producer name (processor.PRODUCER; not imported: processor.py imports this module). Its
# MachineAssignedToEntitlement events are echoes of a TasksAllocated.machines_added: see "Allocator echoes".
ALLOCATOR_PRODUCER = "allocator"

_FIELDS = ("region", "dc", "msb", "rack", "type", "cpu_cap", "mem_cap", "cpu_free", "mem_free", "entitlement",
           "status", "host_profile", "version")


class IndexApplyError(RuntimeError):
    """An event the index cannot apply; nothing was written (not even the applied mark)."""


class UnknownMachine(IndexApplyError):
    pass


class MissingResources(IndexApplyError):
    """A TasksAllocated places a task whose AllocationRequested (with its cpu/mem) was not applied."""


@dataclass(frozen=True)
class CommitResult:
    ok: bool
    conflicts: Mapping[str, str]  # machine_id -> CONFLICT_* (empty when ok)
    versions: Mapping[str, int]  # machine_id -> version after the commit (empty on conflict)
    epochs: tuple[int, int] = (0, 0)  # the entitlement's epoch right before and after the commit (when ok)


# ---------------------------------------------------------------------------------------------------------
# Lua. The prelude is shared by the apply and commit scripts so both write a fact the same way.

_LUA_PRELUDE = r"""
local P = ARGV[1]
local function k(s) return P .. s end
local CAUSE = ''  -- the event (or request) whose step this is; set by each script
local FIELDS = {""" + ", ".join(f"'{f}'" for f in _FIELDS) + r"""}
local INDEXED = {dc = 'idx:dc:', type = 'idx:type:', status = 'idx:status:'}

local function load(id)
  local v = redis.call('HMGET', k('m:' .. id), unpack(FIELDS))
  if not v[1] then return nil end
  local m = {id = id}
  for i, f in ipairs(FIELDS) do m[f] = v[i] end
  m.cpu_free, m.mem_free = tonumber(m.cpu_free), tonumber(m.mem_free)
  m.cpu_cap, m.mem_cap, m.version = tonumber(m.cpu_cap), tonumber(m.mem_cap), tonumber(m.version)
  return m
end

-- the set that holds the machine as owned: its DC's free pool or its entitlement
local function pool(m)
  if m.entitlement == '' then return k('free:' .. m.dc) end
  return k('ent:' .. m.entitlement)
end

-- set one string attribute, moving the machine between index sets; 1 if it changed
local function set(m, f, v)
  if m[f] == v then return 0 end
  local moves_pool = f == 'entitlement' or (f == 'dc' and m.entitlement == '')
  if moves_pool then redis.call('SREM', pool(m), m.id) end
  if INDEXED[f] then
    redis.call('SREM', k(INDEXED[f] .. m[f]), m.id)
    redis.call('SADD', k(INDEXED[f] .. v), m.id)
  end
  if f == 'dc' then redis.call('SADD', k('dcs'), v) end
  m[f] = v
  if moves_pool then redis.call('SADD', pool(m), m.id) end
  redis.call('HSET', k('m:' .. m.id), f, v)
  return 1
end

local function take(m, cpu, mem)
  m.cpu_free, m.mem_free = m.cpu_free - cpu, m.mem_free - mem
  redis.call('HSET', k('m:' .. m.id), 'cpu_free', m.cpu_free, 'mem_free', m.mem_free)
  redis.call('ZADD', k('z:cpu_free'), m.cpu_free, m.id)
end

local function place_task(m, t, cpu, mem)
  redis.call('HSET', k('placement'), t, m.id)
  redis.call('SADD', k('tasks:' .. m.id), t)
  redis.call('HSET', k('taskres'), t, cpu .. ' ' .. mem)
  take(m, cpu, mem)
end

local function unplace_task(m, t)
  local cpu, mem = string.match(redis.call('HGET', k('taskres'), t), '^(%S+) (%S+)$')
  redis.call('HDEL', k('placement'), t)
  redis.call('SREM', k('tasks:' .. m.id), t)
  redis.call('HDEL', k('taskres'), t)
  take(m, -tonumber(cpu), -tonumber(mem))
end

-- the machine's state changed: queue it for state.machines (the publisher reads, produces, then removes it)
local function changed(id, version)
  redis.call('HSET', k('outbox:machines'), id, version .. ' ' .. CAUSE)
end

-- version += the number of kinds of change (each 0 or 1) this step made to the machine
local function bump(m, kinds)
  local n = 0
  for _, c in pairs(kinds) do n = n + c end
  if n > 0 then
    m.version = redis.call('HINCRBY', k('m:' .. m.id), 'version', n)
    changed(m.id, m.version)
    if m.entitlement ~= '' then redis.call('INCRBY', k('epoch:' .. m.entitlement), n) end
  end
  return m.version
end

-- machines by id, loaded once per step
local function loader()
  local ms = {}
  return function(id)
    if ms[id] == nil then ms[id] = load(id) or false end
    return ms[id] or nil
  end
end

local function hset_many(key, flat)
  for i = 1, #flat, 1000 do
    redis.call('HSET', key, unpack(flat, i, math.min(i + 999, #flat)))
  end
end

-- a release moves a machine only if the entitlement still holds it and no task is left on it: a release read
-- late (after the entitlement took the machine again and placed tasks) is stale and changes nothing
local function releasable(m, ent)
  return m.entitlement == ent and redis.call('EXISTS', k('tasks:' .. m.id)) == 0
end

-- tasks answered (placed or rejected) leave the request's pending set; the request goes when none is left
local function answer(rid, tasks)
  local key = k('req:' .. rid)
  for _, t in ipairs(tasks) do redis.call('HDEL', key, 't:' .. t) end
  if redis.call('HLEN', key) <= 2 then redis.call('DEL', key) end
end
"""

# KEYS[1] applied-mark hash. ARGV: prefix, mark field ("topic/partition"), offset, event type, JSON arguments.
# Returns 0 (already applied), 1 (applied) or an error reply (nothing written).
_LUA_APPLY = _LUA_PRELUDE + r"""
local field, offset, kind, a = ARGV[2], tonumber(ARGV[3]), ARGV[4], cjson.decode(ARGV[5])
local last = redis.call('HGET', KEYS[1], field)
if last and tonumber(last) >= offset then return 0 end
CAUSE = a.cause or ''

local get = loader()
local function unknown(id) return redis.error_reply('UNKNOWN_MACHINE ' .. id) end
local H = {}

H.MachineRegistered = function()
  local m = get(a.id)
  local key = k('m:' .. a.id)
  if not m then
    redis.call('HSET', key, 'region', a.region, 'dc', a.dc, 'msb', a.msb, 'rack', a.rack, 'type', a.type,
               'cpu_cap', a.cpu, 'mem_cap', a.mem, 'cpu_free', a.cpu, 'mem_free', a.mem, 'entitlement', '',
               'status', a.status, 'host_profile', a.host_profile, 'version', 1)
    redis.call('SADD', k('idx:dc:' .. a.dc), a.id)
    redis.call('SADD', k('idx:type:' .. a.type), a.id)
    redis.call('SADD', k('idx:status:' .. a.status), a.id)
    redis.call('SADD', k('free:' .. a.dc), a.id)
    redis.call('SADD', k('dcs'), a.dc)
    redis.call('ZADD', k('z:cpu_free'), a.cpu, a.id)
    changed(a.id, 1)
    return
  end
  local n = 0
  for _, f in ipairs({'region', 'dc', 'msb', 'rack', 'type', 'host_profile'}) do n = n + set(m, f, a[f]) end
  if m.cpu_cap ~= a.cpu or m.mem_cap ~= a.mem then
    take(m, m.cpu_cap - a.cpu, m.mem_cap - a.mem)
    m.cpu_cap, m.mem_cap = a.cpu, a.mem
    redis.call('HSET', key, 'cpu_cap', a.cpu, 'mem_cap', a.mem)
    n = n + 1
  end
  bump(m, {attributes = math.min(n, 1)})
end

H.MachineStatusChanged = function()
  local m = get(a.id)
  if not m then return unknown(a.id) end
  bump(m, {status = set(m, 'status', a.status)})
end

H.HostProfileApplied = function()
  local m = get(a.id)
  if not m then return unknown(a.id) end
  bump(m, {host_profile = set(m, 'host_profile', a.host_profile)})
end

H.MachineAssignedToEntitlement = function()
  local m = get(a.id)
  if not m then return unknown(a.id) end
  if a.echo then return end  -- the allocator's echo: its commit / TasksAllocated carries the fact (module doc)
  if m.entitlement == '' then bump(m, {owner = set(m, 'entitlement', a.ent)}) end
end

H.MachineReleasedToFreePool = function()
  local m = get(a.id)
  if not m then return unknown(a.id) end
  if releasable(m, a.ent) then bump(m, {owner = set(m, 'entitlement', '')}) end
end

H.AllocationRequested = function()
  if #a.tasks == 0 then return end
  local flat = {'cpu', a.cpu, 'mem', a.mem}
  for _, t in ipairs(a.tasks) do flat[#flat + 1] = 't:' .. t; flat[#flat + 1] = 1 end
  hset_many(k('req:' .. a.rid), flat)
end

H.AllocationRejected = function()
  answer(a.rid, a.tasks)
end

H.TasksAllocated = function()
  -- reads and checks first: an error reply must leave nothing written
  for _, id in ipairs(a.added) do if not get(id) then return unknown(id) end end
  local cur, needs_res = {}, false
  for i, p in ipairs(a.placements) do
    if not get(p[2]) then return unknown(p[2]) end
    cur[i] = redis.call('HGET', k('placement'), p[1])
    if cur[i] ~= p[2] then needs_res = true end
  end
  local res = redis.call('HMGET', k('req:' .. a.rid), 'cpu', 'mem')
  if needs_res and not res[1] then return redis.error_reply('MISSING_RESOURCES ' .. a.rid) end
  local kinds = {}
  local function of(id) kinds[id] = kinds[id] or {owner = 0, added = 0, removed = 0}; return kinds[id] end
  for _, id in ipairs(a.added) do
    local m = get(id)
    if m.entitlement == '' then of(id).owner = set(m, 'entitlement', a.ent) end
  end
  local answered = {}
  for i, p in ipairs(a.placements) do
    local t, id = p[1], p[2]
    if cur[i] ~= id then
      if cur[i] then unplace_task(get(cur[i]), t); of(cur[i]).removed = 1 end
      place_task(get(id), t, tonumber(res[1]), tonumber(res[2]))
      of(id).added = 1
    end
    answered[#answered + 1] = t
  end
  answer(a.rid, answered)
  for id, kd in pairs(kinds) do bump(get(id), kd) end
end

H.TasksDeallocated = function()
  for _, id in ipairs(a.released) do if not get(id) then return unknown(id) end end
  local kinds = {}
  local function of(id) kinds[id] = kinds[id] or {owner = 0, removed = 0}; return kinds[id] end
  for _, p in ipairs(a.placements) do
    local t, id = p[1], p[2]
    if redis.call('HGET', k('placement'), t) == id then
      unplace_task(get(id), t)
      of(id).removed = 1
    end
  end
  for _, id in ipairs(a.released) do
    local m = get(id)
    if releasable(m, a.ent) then of(id).owner = set(m, 'entitlement', '') end
  end
  for id, kd in pairs(kinds) do bump(get(id), kd) end
end

local err = H[kind]()
if err then return err end
redis.call('HSET', KEYS[1], field, ARGV[3])
return 1
"""

# KEYS[1] placement hash. ARGV: prefix, entitlement, cpu per task, mem per task,
# JSON [[machine, expected_version, added (0/1), [task, ...]], ...], JSON reason constants.
# Returns {1, {machine, version, ...}} or {0, {machine, reason, ...}} (nothing written).
_LUA_COMMIT = _LUA_PRELUDE + r"""
local ent, cpu, mem = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local plan, R = cjson.decode(ARGV[5]), cjson.decode(ARGV[6])
CAUSE = ARGV[7] or ''
local get = loader()
local conflicts = {}
local epoch_before = tonumber(redis.call('GET', k('epoch:' .. ent)) or '0')
for _, p in ipairs(plan) do
  local id, expected, added, tasks = p[1], p[2], p[3] == 1, p[4]
  local m, reason = get(id), nil
  local n = #tasks
  if not m or m.status ~= R.up then reason = R.status
  elseif m.entitlement ~= (added and '' or ent) then reason = R.owner
  elseif m.cpu_free < cpu * n or m.mem_free < mem * n then reason = R.capacity
  elseif m.version ~= expected then reason = R.version
  else
    for _, t in ipairs(tasks) do
      if redis.call('HEXISTS', k('placement'), t) == 1 then reason = R.task_placed; break end
    end
  end
  if reason then conflicts[#conflicts + 1] = id; conflicts[#conflicts + 1] = reason end
end
if #conflicts > 0 then return {0, conflicts} end

local versions = {}
for _, p in ipairs(plan) do
  local m, owner = get(p[1]), 0
  if p[3] == 1 then owner = set(m, 'entitlement', ent) end
  for _, t in ipairs(p[4]) do place_task(m, t, cpu, mem) end
  versions[#versions + 1] = m.id
  versions[#versions + 1] = bump(m, {owner = owner, added = #p[4] > 0 and 1 or 0})
end
return {1, versions, epoch_before, tonumber(redis.call('GET', k('epoch:' .. ent)) or '0')}
"""

# ARGV: prefix, machine id, ... Returns one string: per machine present, its id and _FIELDS joined by \31,
# machines joined by \30 (one bulk reply parses far faster in Python than 13 replies per machine). Read in
# chunks of _READ_CHUNK machines so one call holds the server for a few milliseconds only.
_LUA_READ = _LUA_PRELUDE + r"""
local out = {}
for i = 2, #ARGV do
  local v = redis.call('HMGET', k('m:' .. ARGV[i]), unpack(FIELDS))
  if v[1] then out[#out + 1] = ARGV[i] .. '\31' .. table.concat(v, '\31') end
end
return table.concat(out, '\30')
"""
_READ_CHUNK = 1000

# KEYS[1] the outbox. ARGV: machine, version published, ... Removes a machine whose queued version is at most
# the one published (a change queued meanwhile stays). Returns how many were removed.
_LUA_OUTBOX_DONE = r"""
local n = 0
for i = 1, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v and tonumber(string.match(v, '^(%d+)')) <= tonumber(ARGV[i + 1]) then
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""
OUTBOX = "outbox:machines"

_COMMIT_REASONS = json.dumps({"up": MACHINE_UP, "status": CONFLICT_STATUS, "owner": CONFLICT_OWNER,
                              "capacity": CONFLICT_CAPACITY, "version": CONFLICT_VERSION,
                              "task_placed": CONFLICT_TASK_PLACED})


# ---------------------------------------------------------------------------------------------------------
# Events -> the arguments the apply script reads. One row per event type the index applies.

def _placements(payload: Mapping[str, Any]) -> list[list[str]]:
    return [[p["task_id"], p["machine_id"]] for p in payload["placements"]]


_ARGS: Mapping[str, Callable[[Event], dict]] = MappingProxyType({
    "MachineRegistered": lambda e: {
        "id": e.payload["machine_id"], **{f: e.payload["topology"][f] for f in ("region", "dc", "msb", "rack")},
        "type": e.payload["machine_type"], "cpu": e.payload["capacity"]["cpu_millicores"],
        "mem": e.payload["capacity"]["memory_mib"], "host_profile": e.payload.get("host_profile") or "",
        "status": REGISTERED_STATUS},
    "MachineStatusChanged": lambda e: {"id": e.payload["machine_id"], "status": e.payload["status"]},
    "HostProfileApplied": lambda e: {"id": e.payload["machine_id"], "host_profile": e.payload["host_profile"] or ""},
    "MachineAssignedToEntitlement": lambda e: {"id": e.payload["machine_id"], "ent": e.entitlement,
                                               "echo": e.producer == ALLOCATOR_PRODUCER},
    "MachineReleasedToFreePool": lambda e: {"id": e.payload["machine_id"], "ent": e.entitlement},
    "AllocationRequested": lambda e: {
        "rid": e.payload["request_id"], "tasks": list(e.payload["place_task_ids"]),
        "cpu": e.payload["resources"]["cpu_millicores"], "mem": e.payload["resources"]["memory_mib"]},
    "AllocationRejected": lambda e: {"rid": e.payload["request_id"], "tasks": list(e.payload["unplaced_task_ids"])},
    "TasksAllocated": lambda e: {
        "rid": e.payload["request_id"], "ent": e.entitlement, "placements": _placements(e.payload),
        "added": list(e.payload.get("machines_added", ()))},
    "TasksDeallocated": lambda e: {
        "ent": e.entitlement, "placements": _placements(e.payload),
        "released": list(e.payload.get("machines_released", ()))},
})

EVENT_TYPES = frozenset(_ARGS)


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _to_machine(mid: str, v: Sequence[Any]) -> Machine:
    f = dict(zip(_FIELDS, map(_s, v)))
    return Machine(id=mid, dc=f["dc"], msb=f["msb"], rack=f["rack"], machine_type=f["type"],
                   cpu_free=int(f["cpu_free"]), mem_free=int(f["mem_free"]), cpu_capacity=int(f["cpu_cap"]),
                   mem_capacity=int(f["mem_cap"]), entitlement=f["entitlement"] or None, status=f["status"],
                   version=int(f["version"]))


def _raise_index_error(exc: ResponseError) -> None:
    msg = str(exc)  # a pipeline prefixes the script's message with the command's place in the pipeline
    for marker, error in (("UNKNOWN_MACHINE ", UnknownMachine), ("MISSING_RESOURCES ", MissingResources)):
        if marker in msg:
            raise error(msg[msg.index(marker):]) from None
    raise exc


class MachineIndex:
    """The machine index under ``prefix`` in ``redis_client``; ``consumer`` names its applied marks."""

    def __init__(self, redis_client, prefix: str, consumer: str = DEFAULT_CONSUMER) -> None:
        self.r = redis_client
        self.prefix = prefix
        self.consumer = consumer
        self._apply = redis_client.register_script(_LUA_APPLY)
        self._commit = redis_client.register_script(_LUA_COMMIT)
        self._read = redis_client.register_script(_LUA_READ)
        self._outbox_done = redis_client.register_script(_LUA_OUTBOX_DONE)

    def key(self, name: str) -> str:
        return self.prefix + name

    # --- materializing ----------------------------------------------------------------------------------

    def _apply_args(self, event: Event, position: tuple[str, int, int]) -> tuple[list, list]:
        if event.type not in _ARGS:
            raise ValueError(f"the machine index does not apply {event.type}; it applies {sorted(EVENT_TYPES)}")
        topic, partition, offset = position
        return ([self.key(f"applied:{self.consumer}")],
                [self.prefix, f"{topic}/{partition}", int(offset), event.type,
                 json.dumps({**_ARGS[event.type](event), "cause": event.event_id}, separators=(",", ":"))])

    def apply(self, event: Event, position: tuple[str, int, int]) -> bool:
        """Apply ``event`` read at ``position`` (topic, partition, offset); False if that offset was applied."""
        keys, args = self._apply_args(event, position)
        try:
            return bool(self._apply(keys=keys, args=args))
        except ResponseError as exc:
            _raise_index_error(exc)

    def apply_many(self, records: Iterable[tuple[Event, tuple[str, int, int]]], batch: int = 500) -> int:
        """Apply (event, position) records in order, pipelined ``batch`` at a time; how many were new.

        Raises on the first record that cannot apply; the records after it in its batch were applied already
        (each is atomic and marked, so running the same records again is safe)."""
        applied, pipe, n = 0, self.r.pipeline(transaction=False), 0
        for event, position in records:
            keys, args = self._apply_args(event, position)
            self._apply(keys=keys, args=args, client=pipe)
            n += 1
            if n == batch:
                applied += self._flush(pipe)
                n = 0
        return applied + (self._flush(pipe) if n else 0)

    def _flush(self, pipe) -> int:
        results = pipe.execute(raise_on_error=False)
        if errors := [r for r in results if isinstance(r, Exception)]:
            _raise_index_error(errors[0])
        return sum(map(bool, results))

    def rebuild(self, records: Iterable[tuple[Event, tuple[str, int, int]]]) -> int:
        """Clear the index and apply ``records`` (the log, in order) from scratch."""
        self.clear()
        return self.apply_many(records)

    # --- reading ----------------------------------------------------------------------------------------

    def snapshot(self, dc: str | None = None, machine_type: str | None = None, entitlement: str | None = None,
                 include_free: bool = True) -> dict[str, Machine]:
        """The machines ``entitlement`` holds plus (``include_free``) the free pool, narrowed to ``dc`` and
        ``machine_type`` with the index sets. Each machine is read whole; machines are not read at one
        instant, which the commit's per-machine version check makes harmless."""
        narrow = [self.key(f"idx:type:{machine_type}")] if machine_type is not None else []
        sources = []
        if entitlement is not None:
            sources.append([self.key(f"ent:{entitlement}")] + ([self.key(f"idx:dc:{dc}")] if dc else []))
        if include_free:
            dcs = [dc] if dc is not None else sorted(map(_s, self.r.smembers(self.key("dcs"))))
            sources += [[self.key(f"free:{d}")] for d in dcs]
        pipe = self.r.pipeline(transaction=False)
        for keys in sources:
            pipe.sinter(keys + narrow)
        ids = sorted({_s(m) for members in pipe.execute() for m in members}) if sources else []
        return self.machines(ids)

    def machines(self, ids: Iterable[str]) -> dict[str, Machine]:
        """The machines of ``ids`` that exist, read in pipelined chunks."""
        ids = list(ids)
        pipe = self.r.pipeline(transaction=False)
        for i in range(0, len(ids), _READ_CHUNK):
            self._read(keys=[self.key(f"m:{ids[i]}")], args=[self.prefix, *ids[i:i + _READ_CHUNK]], client=pipe)
        out = {}
        for blob in pipe.execute():
            for record in filter(None, _s(blob).split("\x1e")):
                mid, *values = record.split("\x1f")
                out[mid] = _to_machine(mid, values)
        return out

    def machine(self, machine_id: str) -> Machine | None:
        return self.machines([machine_id]).get(machine_id)

    def held_count(self, entitlement: str) -> int:
        return self.r.scard(self.key(f"ent:{entitlement}"))

    def epoch(self, entitlement: str) -> int:
        """The entitlement's epoch: it grows with every change to a machine while the entitlement holds it."""
        return int(self.r.get(self.key(f"epoch:{entitlement}")) or 0)

    def placements(self) -> dict[str, str]:
        """task -> machine, every placement in the index."""
        return {_s(t): _s(m) for t, m in self.r.hgetall(self.key("placement")).items()}

    @staticmethod
    def in_snapshot(m: Machine, entitlement: str, dc: str | None = None, machine_type: str | None = None) -> bool:
        """Whether ``snapshot(dc, machine_type, entitlement)`` (with the free pool) holds machine ``m``."""
        return (m.entitlement is None or m.entitlement == entitlement) and dc in (None, m.dc) \
            and machine_type in (None, m.machine_type)

    # --- state.machines: the outbox ---------------------------------------------------------------------

    def outbox(self, limit: int = 1000) -> dict[str, tuple[int, str]]:
        """Up to ``limit`` machines whose state changed and is not published yet: id -> (version, cause)."""
        out = {}
        for mid, v in self.r.hscan_iter(self.key(OUTBOX), count=limit):
            version, _, cause = _s(v).partition(" ")
            out[_s(mid)] = (int(version), cause)
            if len(out) >= limit:
                break
        return out

    def states(self, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Every field of the machines of ``ids`` that exist (strings, as stored) plus ``task_ids`` (sorted),
        each machine read in one MULTI so its fields and tasks agree."""
        ids = list(ids)
        pipe = self.r.pipeline(transaction=True)
        for mid in ids:
            pipe.hgetall(self.key(f"m:{mid}"))
            pipe.smembers(self.key(f"tasks:{mid}"))
        res = pipe.execute() if ids else []
        return {mid: {"id": mid, **{_s(f): _s(v) for f, v in fields.items()}, "task_ids": sorted(map(_s, tasks))}
                for mid, fields, tasks in zip(ids, res[::2], res[1::2]) if fields}

    def outbox_done(self, published: Mapping[str, int]) -> int:
        """Remove published machines from the outbox, unless a later change of theirs was queued meanwhile."""
        flat = [x for mid, v in published.items() for x in (mid, int(v))]
        return int(self._outbox_done(keys=[self.key(OUTBOX)], args=flat)) if flat else 0

    # --- the optimistic commit ------------------------------------------------------------------------

    def commit(self, plan_placements: Iterable[tuple[str, str]], expected_versions: Mapping[str, int],
               entitlement: str, cpu: int, mem: int, machines_added: Iterable[str] = (),
               cause: str = "") -> CommitResult:
        """Compare-and-set a plan: all its placements, or none and the conflicting machines; see the module doc.
        ``cause`` (the request's event id) is recorded with the machines' changes for state.machines."""
        tasks: dict[str, list[str]] = defaultdict(list)
        for task_id, machine_id in plan_placements:
            tasks[machine_id].append(task_id)
        added = set(machines_added)
        for mid in added:
            tasks.setdefault(mid, [])
        if missing := set(tasks) - set(expected_versions):
            raise ValueError(f"no expected version for machines {sorted(missing)}")
        plan = [[mid, int(expected_versions[mid]), int(mid in added), ts] for mid, ts in sorted(tasks.items())]
        ok, flat, *epochs = self._commit(keys=[self.key("placement")],
                                args=[self.prefix, entitlement, int(cpu), int(mem),
                                      json.dumps(plan, separators=(",", ":")), _COMMIT_REASONS, cause])
        pairs = dict(zip(map(_s, flat[::2]), flat[1::2]))
        if ok:
            return CommitResult(True, MappingProxyType({}), MappingProxyType({m: int(v) for m, v in pairs.items()}),
                                (int(epochs[0]), int(epochs[1])))
        return CommitResult(False, MappingProxyType({m: _s(r) for m, r in pairs.items()}), MappingProxyType({}))

    # --- whole-index ------------------------------------------------------------------------------------

    def _keys(self) -> list[str]:
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "*"
        return sorted(_s(k) for k in self.r.scan_iter(match=pattern, count=1000))

    def dump(self) -> dict[str, Any]:
        """Every key of the index under the prefix (without it) -> its value: hash dict, set sorted list, zset
        dict, str. The outbox is left out: it is the state publisher's queue, not materialized state."""
        keys = [k for k in self._keys() if not k[len(self.prefix):].startswith("outbox:")]
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.type(k)
        types = [_s(t) for t in pipe.execute()]
        read = {"hash": pipe.hgetall, "set": pipe.smembers, "zset": lambda k: pipe.zrange(k, 0, -1, withscores=True),
                "string": pipe.get}
        for k, t in zip(keys, types):
            read[t](k)
        out = {}
        for k, t, v in zip(keys, types, pipe.execute()):
            name = k[len(self.prefix):]
            if t == "hash":
                out[name] = {_s(f): _s(x) for f, x in v.items()}
            elif t == "set":
                out[name] = sorted(map(_s, v))
            elif t == "zset":
                out[name] = {_s(m): s for m, s in v}
            else:
                out[name] = _s(v)
        return out

    def clear(self) -> int:
        keys = self._keys()
        for i in range(0, len(keys), 1000):
            self.r.unlink(*keys[i:i + 1000])
        return len(keys)


# ---------------------------------------------------------------------------------------------------------

def allocate(index: MachineIndex, entitlement: Entitlement, request: Request,
             held_count_fn: Callable[[], int] | None = None,
             max_attempts: int = 5, *, cache: AllocationCache | None = None,
             before_commit: Callable[[Plan, int, Mapping[str, Machine]], None] | None = None, cause: str = "",
             clock: Callable[[], float] = time.monotonic) -> tuple[Plan, int, tuple[Mapping[str, str], ...]]:
    """Snapshot -> ``placement.place`` -> ``index.commit``, re-planning on a fresh snapshot after a conflict.

    Returns the committed plan (its unplaced tasks and reason as ``place`` gave them), the attempts made, and
    the conflicts of each failed attempt. A plan that places nothing is returned without a commit; when every
    attempt conflicts, the plan places nothing and its reason is COMMIT_RETRIES_EXHAUSTED.

    With a ``cache`` (processors/allocator/cache.py) the first attempt asks it first: a hit reads only the
    entry's machines instead of the snapshot, and its plan (``cache_hit``) is committed like any other; a miss
    places on the snapshot and stores a new entry. ``before_commit(plan, attempt, machines)`` runs before each
    commit (the processor journals there); ``cause`` is recorded with the changes for state.machines.
    """
    if held_count_fn is None:
        def held_count_fn() -> int:
            return index.held_count(entitlement.name)
    dc = request.requirements.get("dc") or entitlement.dc_pin
    machine_type = request.requirements.get("machine_type") or entitlement.machine_type
    shape = shape_of(entitlement, request) if cache is not None else None
    conflicts: list[Mapping[str, str]] = []
    plan = None
    for attempt in range(1, max_attempts + 1):
        plan = None
        if shape is not None and attempt == 1 and (entry := cache.get(shape, clock())) is not None:
            epoch, held = index.epoch(entitlement.name), held_count_fn()  # read before the machines
            on = set(request.existing.values())
            snap = index.machines(set(entry.machines) | on)
            existing_on = {mid: m for mid in on if (m := snap.get(mid)) is not None
                           and index.in_snapshot(m, entitlement.name, dc, machine_type)}
            plan = cache_lookup(entry, snap, existing_on, entitlement, request, held, epoch)
        if plan is None:
            epoch = index.epoch(entitlement.name) if shape is not None else 0  # read before the snapshot
            snap = index.snapshot(dc=dc, machine_type=machine_type, entitlement=entitlement.name)
            held = held_count_fn()
            outcome = placement.run(snap, entitlement, request, held)
            plan = outcome.plan
            if shape is not None:
                cache.put(shape, build_entry(outcome.feasible, entitlement, request, plan.filter_rejections, held,
                                             epoch, clock()) if plan.placements else None)
        if not plan.placements:
            if plan.reason == NO_FEASIBLE_MACHINE and (dc or machine_type):
                # The narrowed snapshot hides why the other machines did not fit: explain over all of them
                # (only the explanation is taken; nothing is committed from this second look).
                wide = placement.place(index.snapshot(entitlement=entitlement.name), entitlement, request,
                                       held_count_fn())
                if not wide.placements and wide.reason == NO_FEASIBLE_MACHINE:
                    plan = replace(plan, filter_rejections=wide.filter_rejections, message=wide.message)
            return plan, attempt, tuple(conflicts)
        touched = {mid for _, mid in plan.placements} | set(plan.machines_added)
        if before_commit is not None:
            before_commit(plan, attempt, snap)
        result = index.commit(plan.placements, {mid: snap[mid].version for mid in touched}, entitlement.name,
                              request.cpu, request.mem, plan.machines_added, cause=cause)
        if result.ok:
            if cache is not None:  # write-through, into every entry
                cache.observe_commit(entitlement.name, machines_after(snap, plan, entitlement.name, request.cpu,
                                                                      request.mem, result.versions),
                                     len(plan.machines_added), *result.epochs)
            return plan, attempt, tuple(conflicts)
        if shape is not None:
            cache.drop(shape)
        conflicts.append(result.conflicts)
    reasons = sorted({r for c in conflicts for r in c.values()})
    bins = Counter(placement.fault_domain(snap[mid], request.spread) for tid, mid in request.existing.items()
                   if tid not in request.task_ids and mid in snap)
    return replace(plan, placements=(), machines_added=(), unplaced=request.task_ids, cache_hit=False,
                   fault_domain_bins=MappingProxyType(dict(sorted(bins.items()))),
                   reason=COMMIT_RETRIES_EXHAUSTED,
                   message=(f"{len(request.task_ids)} tasks of job {request.job_id} unplaced: {max_attempts} commit "
                            f"attempts met conflicts ({', '.join(reasons)})")), max_attempts, tuple(conflicts)
