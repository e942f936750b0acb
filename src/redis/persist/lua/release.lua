-- KEYS: the engine lease. ARGV: holder. Deletes the lease if `holder` has it.

if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
