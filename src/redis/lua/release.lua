-- Compensation: gives a reservation's unit back exactly once (RESERVED -> RELEASED). A
-- repeat is a no-op, so a redelivered compensation message can never release twice.
-- While a rebuild holds the shard (KEYS[7] present) nothing moves: 'HELD', asked again later.
-- KEYS: 1 reservation, 2 sku, 3 buyers, 4 requests, 5 pending index, 6 pending-since index,
--       7 the shard's rebuild hold
-- ARGV: 1 reservation_id, 2 reason, 3 now_ms
if redis.call('EXISTS', KEYS[7]) == 1 then return 'HELD' end
local h = redis.call('HMGET', KEYS[1], 'status', 'user_id', 'req_field')
if not h[1] then return 'MISSING' end
if h[1] ~= 'RESERVED' then return 'ALREADY_RELEASED' end
redis.call('HSET', KEYS[1], 'status', 'RELEASED', 'released_at', ARGV[3], 'release_reason', ARGV[2])
redis.call('HINCRBY', KEYS[2], 'remaining', 1)
if redis.call('HGET', KEYS[3], h[2]) == ARGV[1] then redis.call('HDEL', KEYS[3], h[2]) end
if h[3] and redis.call('HGET', KEYS[4], h[3]) == ARGV[1] then redis.call('HDEL', KEYS[4], h[3]) end
-- A message that reached the consumer needs no more re-sends.
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
return 'RELEASED'
