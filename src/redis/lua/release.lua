-- Compensation: gives a reservation's unit back exactly once (RESERVED -> RELEASED). A
-- repeat is a no-op, so a redelivered compensation message can never release twice.
-- While a rebuild holds the shard (K.rebuilding present) nothing moves: 'HELD', asked again later.
local K = {
  reservation = KEYS[1],
  sku = KEYS[2],
  buyers = KEYS[3],
  requests = KEYS[4],
  pending = KEYS[5],          -- the pending index
  pending_since = KEYS[6],    -- the pending-since index
  rebuilding = KEYS[7],       -- the shard's rebuild hold
}
local A = {
  reservation_id = ARGV[1],
  reason = ARGV[2],
  now_ms = ARGV[3],
}
if redis.call('EXISTS', K.rebuilding) == 1 then return 'HELD' end
local h = redis.call('HMGET', K.reservation, 'status', 'user_id', 'req_field')
if not h[1] then return 'MISSING' end
if h[1] ~= 'RESERVED' then return 'ALREADY_RELEASED' end
redis.call('HSET', K.reservation, 'status', 'RELEASED', 'released_at', A.now_ms, 'release_reason', A.reason)
redis.call('HINCRBY', K.sku, 'remaining', 1)
if redis.call('HGET', K.buyers, h[2]) == A.reservation_id then redis.call('HDEL', K.buyers, h[2]) end
if h[3] and redis.call('HGET', K.requests, h[3]) == A.reservation_id then redis.call('HDEL', K.requests, h[3]) end
-- A message that reached the consumer needs no more re-sends.
redis.call('ZREM', K.pending, A.reservation_id)
redis.call('ZREM', K.pending_since, A.reservation_id)
return 'RELEASED'
