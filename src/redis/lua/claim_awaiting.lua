-- Scanner claim of confirmed sends the consumers may never have taken
-- (docs/architecture/messages.md#a-dead-brokers-messages). The awaiting index scores each MQ_SENT
-- reservation by the time its last copy was sent; this takes up to A.batch sent before
-- other scanner sees them before the lease runs out (a crashed scanner's claims come back).
-- Reservations with nothing left to watch (gone, released, or no longer MQ_SENT) leave the
-- index here.
-- Returns {remaining, reservation_id, its hash as field/value pairs, ...}: remaining is the
-- index's size after the claim.
local K = {
  awaiting = KEYS[1],    -- the awaiting index
}
local A = {
  cutoff = ARGV[1],                -- the send time score before which a reservation is due
  batch = ARGV[2],                 -- how many to claim at most
  lease_ms = ARGV[3],
  reservation_prefix = ARGV[4],    -- the reservation key prefix
}
local due = redis.call('ZRANGEBYSCORE', K.awaiting, '-inf', A.cutoff, 'LIMIT', 0, tonumber(A.batch))
local out = {0}
for _, rid in ipairs(due) do
  local rk = A.reservation_prefix .. rid
  local h = redis.call('HMGET', rk, 'mq_status', 'status')
  if h[1] ~= 'MQ_SENT' or h[2] == 'RELEASED' then
    redis.call('ZREM', K.awaiting, rid)
  else
    redis.call('ZADD', K.awaiting, tonumber(A.cutoff) + tonumber(A.lease_ms), rid)
    table.insert(out, rid)
    table.insert(out, redis.call('HGETALL', rk))
  end
end
out[1] = redis.call('ZCARD', K.awaiting)
return out
