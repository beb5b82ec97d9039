-- DEFINITE_FAILURE: the broker surely did not store *this* copy. Terminal MQ_FAILED, and the
-- reservation is released exactly once (guarded by status RESERVED): stock back, the buyer
-- and the request id may try again. Not when an earlier attempt is uncertain (`uncertain`, set
-- by an UNKNOWN outcome or a scanner's claim): that copy may be stored and become an order, so
-- the reservation stays MQ_PENDING and only PostgreSQL can settle it (docs/architecture/hot-path.md#uncertain-sends).
-- KEYS: 1 reservation, 2 pending index, 3 sku, 4 buyers, 5 requests, 6 pending-since index
-- ARGV: 1 message_id, 2 reservation_id, 3 error text, 4 now_ms
local h = redis.call('HMGET', KEYS[1], 'message_id', 'mq_status', 'status', 'user_id', 'req_field',
  'uncertain')
if not h[1] then return 'MISSING' end
if h[1] ~= ARGV[1] then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
if h[6] == '1' then
  redis.call('HSET', KEYS[1], 'last_error', ARGV[3])
  return 'UNCERTAIN'
end
redis.call('HSET', KEYS[1], 'mq_status', 'MQ_FAILED', 'last_error', ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[6], ARGV[2])
if h[3] == 'RESERVED' then
  redis.call('HSET', KEYS[1], 'status', 'RELEASED', 'released_at', ARGV[4], 'release_reason', 'SEND_FAILED')
  redis.call('HINCRBY', KEYS[3], 'remaining', 1)
  if redis.call('HGET', KEYS[4], h[4]) == ARGV[2] then redis.call('HDEL', KEYS[4], h[4]) end
  if h[5] and redis.call('HGET', KEYS[5], h[5]) == ARGV[2] then redis.call('HDEL', KEYS[5], h[5]) end
  return 'RELEASED'
end
return 'OK'
