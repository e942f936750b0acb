-- KEYS: the queue's stats HASH. ARGV: field1, n1, field2, n2, ... Adds each `n` to its field
-- with HINCRBY; a field another client made a non-integer is left as it is and the others are
-- still added (so a retry of this call is never needed, and nothing is added twice). Returns
-- how many fields were refused.

local refused = 0
for i = 1, #ARGV, 2 do
  local r = redis.pcall('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  if type(r) == 'table' and r.err then refused = refused + 1 end
end
return refused
