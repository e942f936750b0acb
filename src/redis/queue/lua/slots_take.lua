-- KEYS: running (ZSET: slot name → lease deadline, ms on Redis's clock). ARGV: cap, lease
-- (ms), holder (a consumer's instance name), want, first number.
-- A topic's concurrency slots: drops the slots whose lease ran out (their consumer died or
-- stopped renewing), then grants up to `want` of the room left under `cap`, named
-- `holder:number` from the first number up, each leased until now + lease.
-- Reply: {now, name1, name2, ...}: Redis's clock (ms) and the slots granted (maybe none).

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local room = tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1])
local want, first = tonumber(ARGV[4]), tonumber(ARGV[5])
local reply = {now}
local deadline = now + tonumber(ARGV[2])
for i = 0, math.min(want, room) - 1 do
  local name = ARGV[3] .. ':' .. tostring(first + i)
  redis.call('ZADD', KEYS[1], deadline, name)
  reply[#reply + 1] = name
end
return reply
