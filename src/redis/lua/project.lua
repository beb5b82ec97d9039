-- Buyer-facing projection of an order event (docs/architecture/messages.md#event-ordering): applied in
-- its order's sequence. An event not newer than what the key holds is STALE (a duplicate or a
-- stale replay: a no-op); with in_order, one that skips a version is a GAP, left for its caller
-- to hold until the earlier event comes (or to read PostgreSQL's state and apply it without).
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
  in_order = ARGV[8],          -- '1': refuse an event that skips a version (GAP)
}
local cur = tonumber(redis.call('HGET', K.projection, 'version') or '0')
if cur >= tonumber(A.version) then return 'STALE' end
if A.in_order == '1' and cur + 1 < tonumber(A.version) then return 'GAP' end
redis.call('HSET', K.projection, 'version', A.version, 'status', A.status, 'order_id', A.order_id,
  'reservation_id', A.reservation_id, 'updated_at', A.now_ms, 'user_id', A.user_id)
redis.call('EXPIRE', K.projection, tonumber(A.ttl_secs))
return 'APPLIED'
