-- A reservation leaves MQ_PENDING (compare-and-set on message_id) and both pending indexes:
-- CONFIRMED -> MQ_SENT with the broker's id and the send time; or, settled from PostgreSQL
-- (docs/architecture/hot-path.md#uncertain-sends), MQ_SENT (a copy reached the consumer) or MQ_FENCED
-- (none did, none ever will) with the settle time. The unit is not touched here.
-- A confirmed send also enters the awaiting index, scored by its send time: the scanner
-- checks later that the consumers took it, and sends it again if the broker holding it died
-- (docs/architecture/messages.md#a-dead-brokers-messages).
-- KEYS: 1 reservation, 2 pending index, 3 pending-since index, 4 awaiting index
-- ARGV: 1 message_id, 2 reservation_id, 3 the new mq_status, 4 awaiting score ('' = do not
--       watch), 5.. field/value pairs to record
local h = redis.call('HMGET', KEYS[1], 'message_id', 'mq_status')
if not h[1] then return 'MISSING' end
if h[1] ~= ARGV[1] then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
redis.call('HSET', KEYS[1], 'mq_status', ARGV[3], unpack(ARGV, 5))
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
if ARGV[4] ~= '' then redis.call('ZADD', KEYS[4], ARGV[4], ARGV[2]) end
return 'OK'
