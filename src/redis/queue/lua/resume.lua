-- KEYS: paused. ARGV: channel, message. Lifts a shard's pause and wakes its consumers at once
-- (the message is `<due><suffix>` with due = now, so a consumer claims without waiting for its
-- reconcile). Returns 1 if the shard was paused, 0 if not (then nothing is published).

if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.pcall('PUBLISH', ARGV[1], ARGV[2])
return 1
