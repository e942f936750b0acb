-- KEYS: a task's processed-id marker (`{ns}:done:<id>`). ARGV: this claim's marker
-- (`running:<token>`). Deletes the marker if it is still this claim's, so that a retry runs
-- at once; a `done` marker, or another delivery's that took over, is left alone. Reply: 1 if
-- deleted, else 0.

if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
