-- Warms one activity SKU in one stock bucket (its share of the stock). Idempotent; refuses to
-- change the stock once reservations exist.
-- KEYS: 1 meta, 2 sku, 3 the SKU's buyers, 4 request ids, 5 pending index, 6 pending-since index
-- ARGV: 1 starts_at_ms, 2 ends_at_ms, 3 valid_ms, 4 total (this bucket's share), 5 buckets
-- A retired activity's keys were given an expiry (RedisStore::retire_activity): warming it
-- again (a sale extended) takes it away, so nothing of a live sale expires.
for i = 1, 6 do redis.call('PERSIST', KEYS[i]) end
redis.call('HSET', KEYS[1], 'starts_at_ms', ARGV[1], 'ends_at_ms', ARGV[2], 'valid_ms', ARGV[3],
  'buckets', ARGV[5])
local cur = redis.call('HMGET', KEYS[2], 'total', 'remaining')
if not cur[1] then
  redis.call('HSET', KEYS[2], 'total', ARGV[4], 'remaining', ARGV[4])
  return 'CREATED'
end
if cur[1] == ARGV[4] then return 'UNCHANGED' end
if cur[1] ~= cur[2] then return 'STOCK_IN_USE' end
redis.call('HSET', KEYS[2], 'total', ARGV[4], 'remaining', ARGV[4])
return 'UPDATED'
