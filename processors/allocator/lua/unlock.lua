-- KEYS[1] a lock, ARGV[1] the token its holder set: deleted only by that holder. Returns 1 if deleted.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
