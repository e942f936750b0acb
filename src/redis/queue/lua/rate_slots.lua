-- KEYS: rate (STRING: the topic's theoretical arrival time, ms on Redis's clock, with a
-- fraction). ARGV: emission interval (ms, a float: period / limit), burst tolerance (ms:
-- (burst - 1) × interval), horizon (ms), then the due times (ms, ascending; 0: now) of the
-- tasks asking for a slot.
-- GCRA handing out slots: each task in turn gets the slot max(due, now, tat - tolerance), and
-- tat becomes max(tat, slot) + interval. It stops at the first slot past now + horizon, so a
-- consumer books at most a horizon ahead. Whatever order the asks come in, a window of T ms
-- then holds at most 1 + (T + tolerance) / interval slots: the limit per period, plus the
-- burst.
-- Reply: {now, next, slot1, slot2, ...}: Redis's clock (ms), the earliest time a further slot
-- could be had (ms), and the slots granted (ms, rounded up), one per task from the first: a
-- prefix of the asks.

-- `now`: Redis's clock in ms (the same two lines in every script that reads it; Redis 7
-- replicates a script's effects, so reading the clock is allowed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local last = now + tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if tat < now then tat = now end
local reply = {now, 0}
for i = 4, #ARGV do
  local slot = math.max(tonumber(ARGV[i]) or 0, now, tat - tolerance)
  if slot > last then break end
  tat = math.max(tat, slot) + interval
  reply[#reply + 1] = math.ceil(slot)
end
reply[2] = math.ceil(math.max(now, tat - tolerance))
-- Kept while it matters: once tat is past, the next ask starts from `now` anyway.
redis.call('SET', KEYS[1], string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1000)
return reply
