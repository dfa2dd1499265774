-- ARGV: prefix, JSON [[id, {fields}, [[task, cpu, mem], ...], cause], ...], JSON {mark field: offset},
-- JSON {entitlement: {fields}}, consumer. Returns how many machines were written. A machine whose owner changes
-- moves between the entitlements' HELD sets (what the commit checks quotas against).
local ms, marks, ents, consumer = cjson.decode(ARGV[2]), cjson.decode(ARGV[3]), cjson.decode(ARGV[4]), ARGV[5]
local written = 0
for _, row in ipairs(ms) do
  local id, f, tasks, cause = row[1], row[2], row[3], row[4]
  local key = k('m:' .. id)
  local cur, owner = unpack(redis.call('HMGET', key, 'version', 'entitlement'))
  if tonumber(cur or '0') < f.version then
    owner = owner or ''
    if owner ~= f.entitlement then
      if owner ~= '' then redis.call('SREM', k(HELD .. owner), id) end
      if f.entitlement ~= '' then redis.call('SADD', k(HELD .. f.entitlement), id) end
    end
    local want = {}
    for _, t in ipairs(tasks) do want[t[1]] = t end
    for _, t in ipairs(redis.call('SMEMBERS', k('tasks:' .. id))) do
      if not want[t] then
        if redis.call('HGET', k('placement'), t) == id then
          redis.call('HDEL', k('placement'), t)
          redis.call('HDEL', k('taskres'), t)
        end
        redis.call('SREM', k('tasks:' .. id), t)
      end
    end
    for t, r in pairs(want) do
      redis.call('SADD', k('tasks:' .. id), t)
      redis.call('HSET', k('placement'), t, id)
      redis.call('HSET', k('taskres'), t, r[2] .. ' ' .. r[3])
    end
    local flat = {}
    for _, name in ipairs(FIELDS) do flat[#flat + 1] = name; flat[#flat + 1] = f[name] end
    redis.call('HSET', key, unpack(flat))
    redis.call('HSET', k('outbox:machines'), id, f.version .. ' ' .. cause)
    written = written + 1
  end
end
for fieldname, offset in pairs(marks) do
  local last = redis.call('HGET', k('applied:' .. consumer), fieldname)
  if not last or tonumber(last) < offset then redis.call('HSET', k('applied:' .. consumer), fieldname, offset) end
end
for name, f in pairs(ents) do
  redis.call('DEL', k('entitlement:' .. name))
  for fname, v in pairs(f) do redis.call('HSET', k('entitlement:' .. name), fname, v) end
end
return written
