-- ARGV: prefix, machine id, ... Returns one string: per machine present, its id and FIELDS joined by \31,
-- machines joined by \30 (one bulk reply parses far faster in Python than 13 replies per machine).
local out = {}
for i = 2, #ARGV do
  local v = redis.call('HMGET', k('m:' .. ARGV[i]), unpack(FIELDS))
  for j = 1, #FIELDS do if not v[j] then v[j] = '' end end  -- a field newer than the hash
  if v[1] ~= '' then out[#out + 1] = ARGV[i] .. '\31' .. table.concat(v, '\31') end
end
return table.concat(out, '\30')
