-- An uncertain reservation settled from PostgreSQL (docs/ARCHITECTURE.md#uncertain-sends): it
-- leaves the pending indexes with the verdict as its mq_status (MQ_SENT: a copy reached the
-- consumer; MQ_FENCED: none did, and none ever will). Its unit is not touched here: a fenced
-- reservation is released through release.lua, like any rejection.
-- KEYS: 1 reservation, 2 pending index, 3 pending-since index
-- ARGV: 1 message_id, 2 reservation_id, 3 mq_status, 4 now_ms
local h = redis.call('HMGET', KEYS[1], 'message_id', 'mq_status')
if not h[1] then return 'MISSING' end
if h[1] ~= ARGV[1] then return 'MISMATCH' end
if h[2] ~= 'MQ_PENDING' then return h[2] end
redis.call('HSET', KEYS[1], 'mq_status', ARGV[3], 'settled_at', ARGV[4])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
return 'OK'
