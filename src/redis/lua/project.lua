-- Buyer-facing projection of an order event (docs/architecture/messages.md#event-ordering): applied only when newer than what the
-- key holds, so duplicates and stale replays are no-ops whatever order they arrive in.
-- KEYS: 1 projection key (per reservation)
-- ARGV: 1 aggregate_version, 2 status, 3 order_id, 4 reservation_id, 5 ttl seconds, 6 now_ms,
--       7 user_id (the buyer: only they read the projection)
local cur = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if cur >= tonumber(ARGV[1]) then return 'STALE' end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'status', ARGV[2], 'order_id', ARGV[3],
  'reservation_id', ARGV[4], 'updated_at', ARGV[6], 'user_id', ARGV[7])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
return 'APPLIED'
