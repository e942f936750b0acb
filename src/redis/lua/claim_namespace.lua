-- KEYS: the namespace's kind key, then the role's own keys, then the other role's keys.
-- ARGV: the role, the number of own keys, the type each own key must have, then the other
-- role's name. Refuses (`{'inuse', by, key}`) a namespace whose kind key names another role,
-- or that holds a key only the other role writes (a producer in another language need not
-- set the kind key); refuses (`{'type', key, found, expected}`) one whose kind key or own key
-- has the wrong type. Otherwise claims the kind key for the role if nobody has, and answers
-- `{'ok'}`. Checks before it claims: a refused start claims nothing.

local kind = redis.call('TYPE', KEYS[1])['ok']
if kind ~= 'none' and kind ~= 'string' then return {'type', KEYS[1], kind, 'string'} end
local by = redis.call('GET', KEYS[1])
if by and by ~= ARGV[1] then return {'inuse', by, KEYS[1]} end
local own = tonumber(ARGV[2])
for i = 1, own do
  local found = redis.call('TYPE', KEYS[i + 1])['ok']
  if found ~= 'none' and found ~= ARGV[i + 2] then
    return {'type', KEYS[i + 1], found, ARGV[i + 2]}
  end
end
for i = own + 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then return {'inuse', ARGV[own + 3], KEYS[i]} end
end
if not by then redis.call('SET', KEYS[1], ARGV[1]) end
return {'ok'}
