-- UNKNOWN: the broker may hold the message. Stay MQ_PENDING (stock is NOT released), mark the
-- reservation uncertain (no later refusal may release it: mark_failed.lua) and schedule a
-- re-send with the same message_id.
-- KEYS: 1 reservation, 2 pending index
-- ARGV: 1 message_id, 2 reservation_id, 3 next_retry_at_ms, 4 error text
local h = redis.call('HMGET', KEYS[1], 'message_id', 'mq_status')
if not h[1] then return 'MISSING' end
if h[1] ~= ARGV[1] then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
redis.call('HSET', KEYS[1], 'next_retry_at', ARGV[3], 'last_error', ARGV[4], 'uncertain', '1')
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]), ARGV[2])
return 'OK'
