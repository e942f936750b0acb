-- KEYS: the schedules' last-occurrence HASH, the schedules HASH. ARGV: name, occurrence (ms).
-- Records that the schedule's occurrences up to `occurrence` are enqueued: sets the field if
-- it is absent or lower (schedulers racing never move it back), and only while the schedule
-- exists (a round that read it before its removal does not bring its record back). Returns
-- the value now stored, '' for a schedule removed.

if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return '' end

local now = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > now then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
return tostring(now)
