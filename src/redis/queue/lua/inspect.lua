-- KEYS: due, tasks, lease, owner, dead. ARGV: id. Reads where task `id` stands, in one
-- consistent snapshot, changing nothing. Returns five values, '' for each one absent:
-- its due score (queued), its lease deadline (claimed: ms, Redis's clock), its owner
-- (`consumer|token`), its envelope as stored, and its dead-letter record.

local function get(v) if v then return v else return '' end end
return {
  get(redis.call('ZSCORE', KEYS[1], ARGV[1])),
  get(redis.call('ZSCORE', KEYS[3], ARGV[1])),
  get(redis.call('HGET', KEYS[4], ARGV[1])),
  get(redis.call('HGET', KEYS[2], ARGV[1])),
  get(redis.call('HGET', KEYS[5], ARGV[1])),
}
