-- KEYS[1] the outbox. ARGV: machine, version published, ... Removes a machine whose queued version is at most
-- the one published (a change queued meanwhile stays). Returns how many were removed.
local n = 0
for i = 1, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v and tonumber(string.match(v, '^(%d+)')) <= tonumber(ARGV[i + 1]) then
    redis.call('HDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
