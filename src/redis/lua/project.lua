-- Buyer-facing projection of an order event (docs/architecture/messages.md#event-ordering): applied only when newer than what the
-- key holds, so duplicates and stale replays are no-ops whatever order they arrive in.
local K = {
  projection = KEYS[1],    -- the projection key (per reservation)
}
local A = {
  version = ARGV[1],           -- the aggregate_version
  status = ARGV[2],
  order_id = ARGV[3],
  reservation_id = ARGV[4],
  ttl_secs = ARGV[5],
  now_ms = ARGV[6],
  user_id = ARGV[7],           -- the buyer: only they read the projection
}
local cur = tonumber(redis.call('HGET', K.projection, 'version') or '0')
if cur >= tonumber(A.version) then return 'STALE' end
redis.call('HSET', K.projection, 'version', A.version, 'status', A.status, 'order_id', A.order_id,
  'reservation_id', A.reservation_id, 'updated_at', A.now_ms, 'user_id', A.user_id)
redis.call('EXPIRE', K.projection, tonumber(A.ttl_secs))
return 'APPLIED'
