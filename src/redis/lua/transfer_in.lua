-- Moving leftovers, step 2 (docs/architecture/redis.md#moving-leftovers): credits the units of transfer
-- resumed after a crash never credits twice.
-- Returns 1 when credited now, 0 when it already was, -1 when a rebuild holds the shard.
local K = {
  sku = KEYS[1],
  transfers_in = KEYS[2],    -- the trail
  rebuilding = KEYS[3],      -- the shard's rebuild hold
}
local A = {
  transfer_id = ARGV[1],
  units = ARGV[2],
  from = ARGV[3],           -- the source bucket
  now_ms = ARGV[4],
}
if redis.call('EXISTS', K.rebuilding) == 1 then return -1 end
if redis.call('HEXISTS', K.transfers_in, A.transfer_id) == 1 then return 0 end
redis.call('HINCRBY', K.sku, 'remaining', tonumber(A.units))
redis.call('HINCRBY', K.sku, 'moved_in', tonumber(A.units))
-- The refusals so far are answered by these units: the bucket asks again only after new ones.
redis.call('HSET', K.sku, 'refused_seen', redis.call('HGET', K.sku, 'refused') or '0')
redis.call('HSET', K.transfers_in, A.transfer_id, A.from .. ' ' .. A.units .. ' ' .. A.now_ms)
return 1
