-- Moving leftovers, step 2 (docs/architecture/redis.md#moving-leftovers): credits the units of transfer
-- ARGV[1] to this bucket, once: a transfer id already credited changes nothing, so a move
-- resumed after a crash never credits twice.
-- KEYS: 1 sku, 2 transfers in (the trail), 3 the shard's rebuild hold
-- ARGV: 1 transfer id, 2 units, 3 source bucket, 4 now_ms
-- Returns 1 when credited now, 0 when it already was, -1 when a rebuild holds the shard.
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('HINCRBY', KEYS[1], 'remaining', tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'moved_in', tonumber(ARGV[2]))
-- The refusals so far are answered by these units: the bucket asks again only after new ones.
redis.call('HSET', KEYS[1], 'refused_seen', redis.call('HGET', KEYS[1], 'refused') or '0')
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ' ' .. ARGV[2] .. ' ' .. ARGV[4])
return 1
