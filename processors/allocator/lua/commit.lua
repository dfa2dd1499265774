-- ARGV: prefix, JSON decisions, done TTL (s), JSON reason constants, the index generation ("" = unchecked). A decision:
--   {rid, part, fence, ent, cpu, mem, frees: [[task, machine]], released: [machine], plan: [[machine, expected
--    version, added 0/1, [task...]]], events: "<JSON text>", quota: machines the entitlement may hold (null:
--    unchecked)}
-- Returns one reply per decision: {'ok', {machine, version, ...}} | {'journaled', events} | {'fenced'} |
-- {'conflict', {machine, reason, ...}, {machine the entitlement holds, ...}}; or 'lost' alone, nothing written, when
-- the index is not of that generation. The third part of a conflict lists the entitlement's machines (HELD) when
-- its quota was what failed: the loser reloads those it did not know of.
-- A decision is all or nothing but for its frees (applied whatever follows, as the fold applies them before
-- placing; applying them again changes nothing). HELD (a set per entitlement: the machines it holds, any status)
-- follows every owner change, so a decision that adds free machines is checked against the quota here, where two
-- allocators deciding for one entitlement meet.
if ARGV[5] ~= '' and redis.call('GET', k(GENERATION)) ~= ARGV[5] then return LOST end
local decisions, ttl, R = cjson.decode(ARGV[2]), tonumber(ARGV[3]), cjson.decode(ARGV[4])
local loaded = {}
local function get(id)
  if loaded[id] == nil then
    local v = redis.call('HMGET', k('m:' .. id), unpack(FIELDS))
    if not v[1] then loaded[id] = false else
      local m = {id = id}
      for i, f in ipairs(FIELDS) do m[f] = v[i] end
      for _, f in ipairs({'cpu_cap', 'mem_cap', 'cpu_free', 'mem_free', 'version'}) do m[f] = tonumber(m[f]) end
      loaded[id] = m
    end
  end
  return loaded[id] or nil
end
local function save(m, cause, n)
  m.version = m.version + n
  redis.call('HSET', k('m:' .. m.id), 'entitlement', m.entitlement, 'cpu_free', m.cpu_free, 'mem_free',
             m.mem_free, 'version', m.version)
  redis.call('HSET', k('outbox:machines'), m.id, m.version .. ' ' .. cause)
end
local function place(m, t, cpu, mem)
  redis.call('HSET', k('placement'), t, m.id)
  redis.call('HSET', k('taskres'), t, cpu .. ' ' .. mem)
  redis.call('SADD', k('tasks:' .. m.id), t)
  m.cpu_free, m.mem_free = m.cpu_free - cpu, m.mem_free - mem
end
local function unplace(m, t)
  local cpu, mem = string.match(redis.call('HGET', k('taskres'), t), '^(%S+) (%S+)$')
  redis.call('HDEL', k('placement'), t)
  redis.call('HDEL', k('taskres'), t)
  redis.call('SREM', k('tasks:' .. m.id), t)
  m.cpu_free, m.mem_free = m.cpu_free + tonumber(cpu), m.mem_free + tonumber(mem)
end

local out = {}
for i, d in ipairs(decisions) do
  local done = redis.call('GET', k('alloc:done:' .. d.rid))
  if done then out[i] = {'journaled', done}
  elseif d.fence ~= cjson.null and redis.call('GET', k('alloc:fence:' .. d.part)) ~= tostring(d.fence) then
    out[i] = {'fenced'}
  else
    -- the frees: each task still placed on the named machine is removed; released machines go back
    local kinds = {}
    local function of(id) kinds[id] = kinds[id] or {}; return kinds[id] end
    for _, f in ipairs(d.frees) do
      if redis.call('HGET', k('placement'), f[1]) == f[2] then unplace(get(f[2]), f[1]); of(f[2]).removed = 1 end
    end
    for _, id in ipairs(d.released) do
      local m = get(id)
      if m and m.entitlement == d.ent and redis.call('EXISTS', k('tasks:' .. id)) == 0 then
        m.entitlement = ''
        redis.call('SREM', k(HELD .. d.ent), id)
        of(id).owner = 1
      end
    end
    for id, kd in pairs(kinds) do
      local n = 0
      for _ in pairs(kd) do n = n + 1 end
      save(get(id), d.rid, n)
    end
    -- the plan, re-checked machine by machine, and the machines it adds against the quota
    local conflicts, held, over = {}, {}, false
    local adding = 0
    for _, p in ipairs(d.plan) do if p[3] == 1 then adding = adding + 1 end end
    if adding > 0 and d.quota ~= nil and d.quota ~= cjson.null
        and redis.call('SCARD', k(HELD .. d.ent)) + adding > d.quota then
      over = true
      held = redis.call('SMEMBERS', k(HELD .. d.ent))
    end
    for _, p in ipairs(d.plan) do
      local id, expected, added, tasks = p[1], p[2], p[3] == 1, p[4]
      local m, reason = get(id), nil
      local n = #tasks
      if over and added then reason = R.quota
      elseif not m or m.status ~= R.up then reason = R.status
      elseif m.entitlement ~= (added and '' or d.ent) then reason = R.owner
      elseif m.cpu_free < d.cpu * n or m.mem_free < d.mem * n then reason = R.capacity
      elseif m.version ~= expected then reason = R.version
      else
        for _, t in ipairs(tasks) do
          if redis.call('HEXISTS', k('placement'), t) == 1 then reason = R.task_placed; break end
        end
      end
      if reason then conflicts[#conflicts + 1] = id; conflicts[#conflicts + 1] = reason end
    end
    if #conflicts > 0 then out[i] = {'conflict', conflicts, held} else
      local versions = {}
      for _, p in ipairs(d.plan) do
        local m, n = get(p[1]), 0
        if p[3] == 1 then
          m.entitlement = d.ent
          redis.call('SADD', k(HELD .. d.ent), m.id)
          n = n + 1
        end
        for _, t in ipairs(p[4]) do place(m, t, d.cpu, d.mem) end
        if #p[4] > 0 then n = n + 1 end
        save(m, d.rid, n)
        versions[#versions + 1] = m.id
        versions[#versions + 1] = m.version
      end
      redis.call('SET', k('alloc:done:' .. d.rid), d.events, 'EX', ttl)
      out[i] = {'ok', versions}
    end
  end
end
return out
