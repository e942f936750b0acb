-- KEYS: due, tasks, the engine lease. ARGV: holder (empty: no check). Deletes the live keys (a
-- snapshot of nothing) if the lease is the holder's.

-- The fence, as every script that writes for a Persistent engine opens: with a holder given,
-- the lease (the last key) must be that holder's.
if ARGV[1] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[1] then
  return redis.error_reply('NOTHELD this engine does not hold the namespace lease')
end

redis.call('DEL', KEYS[1], KEYS[2])
return 1
