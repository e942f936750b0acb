-- KEYS: due, tasks, the engine lease. ARGV: holder (empty: no check), then ids. Removes each
-- from both (in slices, as `unpack` takes a bounded number of values), atomically, if the
-- lease is the holder's. A script rather than a MULTI: it can check the lease, and a Redis at
-- `maxmemory`, which refuses every command queued in a MULTI, runs a script whose commands
-- free memory (ZREM and HDEL are not refused there).

-- The fence, as every script that writes for a Persistent engine opens: with a holder given,
-- the lease (the last key) must be that holder's.
if ARGV[1] ~= '' and redis.call('GET', KEYS[#KEYS]) ~= ARGV[1] then
  return redis.error_reply('NOTHELD this engine does not hold the namespace lease')
end

for i = 2, #ARGV, 1000 do
  local j = math.min(i + 999, #ARGV)
  redis.call('ZREM', KEYS[1], unpack(ARGV, i, j))
  redis.call('HDEL', KEYS[2], unpack(ARGV, i, j))
end
return 1
