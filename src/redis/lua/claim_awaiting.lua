-- Scanner claim of confirmed sends the consumers may never have taken
-- (docs/architecture/messages.md#a-dead-brokers-messages). The awaiting index scores each MQ_SENT
-- reservation by the time its last copy was sent; this takes up to ARGV[2] sent before
-- ARGV[1] and leases them to one scanner: the score moves to the cutoff plus ARGV[3], so no
-- other scanner sees them before the lease runs out (a crashed scanner's claims come back).
-- Reservations with nothing left to watch (gone, released, or no longer MQ_SENT) leave the
-- index here.
-- KEYS: 1 awaiting index
-- ARGV: 1 cutoff score, 2 batch, 3 lease_ms, 4 reservation key prefix
-- Returns {remaining, reservation_id, its hash as field/value pairs, ...}: remaining is the
-- index's size after the claim.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local out = {0}
for _, rid in ipairs(due) do
  local rk = ARGV[4] .. rid
  local h = redis.call('HMGET', rk, 'mq_status', 'status')
  if h[1] ~= 'MQ_SENT' or h[2] == 'RELEASED' then
    redis.call('ZREM', KEYS[1], rid)
  else
    redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[3]), rid)
    table.insert(out, rid)
    table.insert(out, redis.call('HGETALL', rk))
  end
end
out[1] = redis.call('ZCARD', KEYS[1])
return out
