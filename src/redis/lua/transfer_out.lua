-- Moving leftovers, step 1 (docs/architecture/redis.md#moving-leftovers): debits up to A.want units of
-- a SKU from this bucket under transfer id A.transfer_id, bound for bucket A.to, and records the
-- transfer as open until the target has credited it. Idempotent: the same transfer id again
-- debits nothing and answers what the first call debited.
-- Returns the units debited (0: none left, nothing recorded; -1: a rebuild holds the shard).
local K = {
  sku = KEYS[1],
  transfers_out = KEYS[2],    -- the trail
  open = KEYS[3],             -- open transfers
  rebuilding = KEYS[4],       -- the shard's rebuild hold
}
local A = {
  transfer_id = ARGV[1],
  want = ARGV[2],           -- units wanted
  to = ARGV[3],             -- the target bucket
  now_ms = ARGV[4],
}
if redis.call('EXISTS', K.rebuilding) == 1 then return -1 end
local done = redis.call('HGET', K.transfers_out, A.transfer_id)
if done then
  local _, n = string.match(done, '^(%S+) (%S+)')
  return tonumber(n)
end
local remaining = tonumber(redis.call('HGET', K.sku, 'remaining') or '0')
local n = math.min(tonumber(A.want), remaining)
if n <= 0 then return 0 end
redis.call('HINCRBY', K.sku, 'remaining', -n)
redis.call('HINCRBY', K.sku, 'moved_out', n)
redis.call('HSET', K.transfers_out, A.transfer_id, A.to .. ' ' .. n .. ' ' .. A.now_ms)
redis.call('ZADD', K.open, tonumber(A.now_ms), A.transfer_id)
return n
