-- A read-only function of the index's library: ARGV: prefix, cursor. One SCAN step over the machines' hashes
-- (COUNT MAX_READ, the pattern made here from the prefix: a caller chooses no glob). Returns {next cursor, id, ...}.
local pattern = string.gsub(P, '[%*%?%[%]\\]', '\\%0') .. 'm:*'
local r = redis.call('SCAN', ARGV[2], 'MATCH', pattern, 'COUNT', MAX_READ)
local out = {r[1]}
local start = #P + 3
for _, key in ipairs(r[2]) do out[#out + 1] = string.sub(key, start) end
return out
