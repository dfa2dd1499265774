-- A read-only function of the index's library (``lua.library``): ARGV: prefix, machine id, ... (at most
-- MAX_READ ids, each at most MAX_NAME bytes: a reader's call is bounded work). Returns one string: per machine
-- present, its id and FIELDS joined by \31, machines joined by \30 (one bulk reply parses far faster in Python
-- than 13 replies per machine).
if #ARGV - 1 > MAX_READ then
  return redis.error_reply('ERR at most ' .. MAX_READ .. ' machines a call, got ' .. (#ARGV - 1))
end
local out = {}
for i = 2, #ARGV do
  if #ARGV[i] > MAX_NAME then return redis.error_reply('ERR a machine id longer than ' .. MAX_NAME .. ' bytes') end
  local v = redis.call('HMGET', k('m:' .. ARGV[i]), unpack(FIELDS))
  for j = 1, #FIELDS do if not v[j] then v[j] = '' end end  -- a field newer than the hash
  if v[1] ~= '' then out[#out + 1] = ARGV[i] .. '\31' .. table.concat(v, '\31') end
end
return table.concat(out, '\30')
