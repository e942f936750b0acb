-- KEYS: scratch due, scratch tasks, due, tasks, the engine lease. ARGV: holder (empty: no
-- check). Renames both scratch keys over the live ones, or (returning 0) changes nothing when
-- either is missing; refuses (`NOTHELD`) unless the lease is the holder's.

-- The fence, as every script that writes for a Persistent engine opens: with a holder given,
-- the lease (the last key) must be that holder's.
if ARGV[1] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[1] then
  return redis.error_reply('NOTHELD this engine does not hold the namespace lease')
end

if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('RENAME', KEYS[1], KEYS[3])
redis.call('RENAME', KEYS[2], KEYS[4])
redis.call('PERSIST', KEYS[3])
redis.call('PERSIST', KEYS[4])
return 1
