-- Moving leftovers, step 1 (docs/architecture/redis.md#moving-leftovers): debits up to ARGV[2] units of
-- a SKU from this bucket under transfer id ARGV[1], bound for bucket ARGV[3], and records the
-- transfer as open until the target has credited it. Idempotent: the same transfer id again
-- debits nothing and answers what the first call debited.
-- KEYS: 1 sku, 2 transfers out (the trail), 3 open transfers, 4 the shard's rebuild hold
-- ARGV: 1 transfer id, 2 units wanted, 3 target bucket, 4 now_ms
-- Returns the units debited (0: none left, nothing recorded; -1: a rebuild holds the shard).
if redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
local done = redis.call('HGET', KEYS[2], ARGV[1])
if done then
  local _, n = string.match(done, '^(%S+) (%S+)')
  return tonumber(n)
end
local remaining = tonumber(redis.call('HGET', KEYS[1], 'remaining') or '0')
local n = math.min(tonumber(ARGV[2]), remaining)
if n <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'remaining', -n)
redis.call('HINCRBY', KEYS[1], 'moved_out', n)
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3] .. ' ' .. n .. ' ' .. ARGV[4])
redis.call('ZADD', KEYS[3], tonumber(ARGV[4]), ARGV[1])
return n
