-- DEFINITE_FAILURE: the broker surely did not store *this* copy. Terminal MQ_FAILED, and the
-- reservation is released exactly once (guarded by status RESERVED): stock back, the buyer
-- and the request id may try again. Not when an earlier attempt is uncertain (`uncertain`, set
-- by an UNKNOWN outcome or a scanner's claim): that copy may be stored and become an order, so
-- the reservation stays MQ_PENDING and only PostgreSQL can settle it (docs/architecture/hot-path.md#uncertain-sends).
local K = {
  reservation = KEYS[1],
  pending = KEYS[2],          -- the pending index
  sku = KEYS[3],
  buyers = KEYS[4],
  requests = KEYS[5],
  pending_since = KEYS[6],    -- the pending-since index
}
local A = {
  message_id = ARGV[1],
  reservation_id = ARGV[2],
  error = ARGV[3],             -- the error text
  now_ms = ARGV[4],
}
local h = redis.call('HMGET', K.reservation, 'message_id', 'mq_status', 'status', 'user_id', 'req_field',
  'uncertain')
if not h[1] then return 'MISSING' end
if h[1] ~= A.message_id then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
if h[6] == '1' then
  redis.call('HSET', K.reservation, 'last_error', A.error)
  return 'UNCERTAIN'
end
redis.call('HSET', K.reservation, 'mq_status', 'MQ_FAILED', 'last_error', A.error)
redis.call('ZREM', K.pending, A.reservation_id)
redis.call('ZREM', K.pending_since, A.reservation_id)
if h[3] == 'RESERVED' then
  redis.call('HSET', K.reservation, 'status', 'RELEASED', 'released_at', A.now_ms, 'release_reason', 'SEND_FAILED')
  redis.call('HINCRBY', K.sku, 'remaining', 1)
  if redis.call('HGET', K.buyers, h[4]) == A.reservation_id then redis.call('HDEL', K.buyers, h[4]) end
  if h[5] and redis.call('HGET', K.requests, h[5]) == A.reservation_id then redis.call('HDEL', K.requests, h[5]) end
  return 'RELEASED'
end
return 'OK'
