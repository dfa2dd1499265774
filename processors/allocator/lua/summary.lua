-- A read-only function of the index's library: ARGV: prefix. Returns the summary hash as HGETALL does (a count per
-- status: a few fields, whatever the region's size).
return redis.call('HGETALL', k(SUMMARY))
