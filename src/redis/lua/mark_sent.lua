-- A reservation leaves MQ_PENDING (compare-and-set on message_id) and both pending indexes:
-- CONFIRMED -> MQ_SENT with the broker's id and the send time; or, settled from PostgreSQL
-- (docs/architecture/hot-path.md#uncertain-sends), MQ_SENT (a copy reached the consumer) or MQ_FENCED
-- (none did, none ever will) with the settle time. The unit is not touched here.
-- A confirmed send also enters the awaiting index, scored by its send time: the scanner
-- checks later that the consumers took it, and sends it again if the broker holding it died
-- (docs/architecture/messages.md#a-dead-brokers-messages).
local K = {
  reservation = KEYS[1],
  pending = KEYS[2],          -- the pending index
  pending_since = KEYS[3],    -- the pending-since index
  awaiting = KEYS[4],         -- the awaiting index
}
local A = {
  message_id = ARGV[1],
  reservation_id = ARGV[2],
  mq_status = ARGV[3],         -- the new mq_status
  awaiting_score = ARGV[4],    -- '' = do not watch
}
local h = redis.call('HMGET', K.reservation, 'message_id', 'mq_status')
if not h[1] then return 'MISSING' end
if h[1] ~= A.message_id then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
-- ARGV after A's names: field/value pairs to record.
redis.call('HSET', K.reservation, 'mq_status', A.mq_status, unpack(ARGV, 5))
redis.call('ZREM', K.pending, A.reservation_id)
redis.call('ZREM', K.pending_since, A.reservation_id)
if A.awaiting_score ~= '' then redis.call('ZADD', K.awaiting, A.awaiting_score, A.reservation_id) end
return 'OK'
