-- KEYS: scratch keys; ARGV: the length of the scratch prefix, the live prefix. Each key renamed to the live prefix
-- (one call per chunk, not one RENAME command and reply per key).
local cut, live = tonumber(ARGV[1]), ARGV[2]
for _, key in ipairs(KEYS) do redis.call('RENAME', key, live .. string.sub(key, cut + 1)) end
return #KEYS
