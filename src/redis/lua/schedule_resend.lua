-- UNKNOWN: the broker may hold the message. Stay MQ_PENDING (stock is NOT released), mark the
-- reservation uncertain (no later refusal may release it: mark_failed.lua) and schedule a
-- re-send with the same message_id.
local K = {
  reservation = KEYS[1],
  pending = KEYS[2],        -- the pending index
}
local A = {
  message_id = ARGV[1],
  reservation_id = ARGV[2],
  next_retry_at_ms = ARGV[3],
  error = ARGV[4],               -- the error text
}
local h = redis.call('HMGET', K.reservation, 'message_id', 'mq_status')
if not h[1] then return 'MISSING' end
if h[1] ~= A.message_id then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
redis.call('HSET', K.reservation, 'next_retry_at', A.next_retry_at_ms, 'last_error', A.error, 'uncertain', '1')
redis.call('ZADD', K.pending, tonumber(A.next_retry_at_ms), A.reservation_id)
return 'OK'
