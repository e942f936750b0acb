-- KEYS: due, tasks, dead. ARGV: per entry, its id, `1` or `0` (whether an envelope was read
-- for it), the envelope read, its dead record, and the score read if that is what is broken
-- (else empty). Moves each entry whose envelope (and broken score) is still the one read (or
-- still missing) to the dead letters, and leaves the others: rewritten since they were read,
-- they are no longer the broken entry. Returns 1 or 0 per entry.

local buried = {}
for i = 1, #ARGV, 5 do
  local id, read, raw, record, score = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local now = redis.call('HGET', KEYS[2], id)
  local same = (read == '1' and now == raw) or (read == '0' and not now)
  if same and score ~= '' then
    same = redis.call('ZSCORE', KEYS[1], id) == score
  end
  if same then
    redis.call('HSET', KEYS[3], id, record)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    buried[#buried + 1] = 1
  else
    buried[#buried + 1] = 0
  end
end
return buried
