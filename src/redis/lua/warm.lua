-- Warms one activity SKU in one stock bucket (its share of the stock). Idempotent; refuses to
-- change the stock once reservations exist.
-- A retired activity's keys were given an expiry (Recovery::retire_activity): warming it
-- again (a sale extended) takes it away, so nothing of a live sale expires.
local K = {
  meta = KEYS[1],
  sku = KEYS[2],
  buyers = KEYS[3],           -- the SKU's buyers
  requests = KEYS[4],         -- request ids
  pending = KEYS[5],          -- the pending index
  pending_since = KEYS[6],    -- the pending-since index
}
local A = {
  starts_at_ms = ARGV[1],
  ends_at_ms = ARGV[2],
  valid_ms = ARGV[3],
  total = ARGV[4],           -- this bucket's share
  buckets = ARGV[5],
}
for _, key in ipairs(KEYS) do redis.call('PERSIST', key) end
redis.call('HSET', K.meta, 'starts_at_ms', A.starts_at_ms, 'ends_at_ms', A.ends_at_ms, 'valid_ms', A.valid_ms,
  'buckets', A.buckets)
local cur = redis.call('HMGET', K.sku, 'total', 'remaining')
if not cur[1] then
  redis.call('HSET', K.sku, 'total', A.total, 'remaining', A.total)
  return 'CREATED'
end
if cur[1] == A.total then return 'UNCHANGED' end
if cur[1] ~= cur[2] then return 'STOCK_IN_USE' end
redis.call('HSET', K.sku, 'total', A.total, 'remaining', A.total)
return 'UPDATED'
