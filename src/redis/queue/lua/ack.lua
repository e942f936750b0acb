-- KEYS: lease, owner, tasks, expired, dead, then (only when some task has a unique window)
-- each task's unique-window marker, in order. ARGV: the tasks in runs that share their owner,
-- `again` and window: owner, again (0/1), window (ms, 0 for none), count, then `count` ids;
-- then the next run. (One header per run, not four arguments per task: a consumer's acks are
-- mostly a few runs, one per claim batch, and each argument costs Redis a string to parse and
-- Lua one to intern.) Removes each task whose owner still matches, and sets the marker of
-- each one removed with a window, expiring after it (`enqueue_unique` refuses the id
-- meanwhile; a window Redis refuses as an expiry sets none). Returns per task, in order, 1
-- (removed), 0 (refused: the lease was taken over, or ran out and the task is queued again or
-- dead-lettered), or, for an ack sent again
-- (`again` = 1) after a call that may have run, 2 if the task is gone, held by no one and not
-- dead-lettered: most likely that call ran and only its reply was lost. (Another consumer's
-- takeover and ack in between, or a producer's cancel, would read the same; without such a
-- call before, they read as 0.)
--
-- The owners are read with one HMGET and the removals are written with one call per key (in
-- chunks), not four calls per task: the answers are those of checking and removing the tasks
-- one by one, in order (an id given twice is removed once, and the second reads as gone).

-- ids[k], and run[k]: where in ARGV task k's run header starts; `count` tasks. (Appends keep
-- their own counts: `#t` is a search in Lua 5.1.)
local ids, run, count = {}, {}, 0
local a = 1
while a <= #ARGV do
  local n = tonumber(ARGV[a + 3])
  for i = a + 4, a + 3 + n do
    count = count + 1
    ids[count] = ARGV[i]
    run[count] = a
  end
  a = a + 4 + n
end
local markers = #KEYS > 5
if count == 0 then return {} end
local owners, o = {}, 0
for i = 1, count, 500 do
  local part = redis.call('HMGET', KEYS[2], unpack(ids, i, math.min(i + 499, count)))
  for j = 1, #part do
    o = o + 1
    owners[o] = part[j]
  end
end
local out, gone, g, removed = {}, {}, 0, {}
for k = 1, count do
  local h = run[k]
  local id, owner, again, window = ids[k], ARGV[h], ARGV[h + 1], ARGV[h + 2]
  if not removed[id] and owners[k] == owner then
    removed[id] = true
    g = g + 1
    gone[g] = id
    out[k] = 1
    -- A window Redis refuses as an expiry (only another client writes one) sets no marker:
    -- an error here would fail every ack of the call, call after call.
    if markers and window ~= '0' then
      redis.pcall('SET', KEYS[5 + k], '1', 'PX', window)
    end
  elseif again == '1' and (removed[id] or (not owners[k] and redis.call('HEXISTS', KEYS[3], id) == 0)) and redis.call('HEXISTS', KEYS[5], id) == 0 then
    out[k] = 2
  else
    out[k] = 0
  end
end
for i = 1, g, 500 do
  local j = math.min(i + 499, g)
  redis.call('ZREM', KEYS[1], unpack(gone, i, j))
  redis.call('HDEL', KEYS[2], unpack(gone, i, j))
  redis.call('HDEL', KEYS[3], unpack(gone, i, j))
  redis.call('HDEL', KEYS[4], unpack(gone, i, j))
end
return out
