-- Scanner claim (docs/architecture/redis.md#pending-index-and-leases): takes up to ARGV[2] due reservations from the pending index and
-- leases them to one scanner: the score moves to the lease expiry, so no other scanner sees
-- them until the lease runs out (a crashed scanner's work comes back by itself). A claimed
-- reservation is marked uncertain: whoever sent it before (the API, or a scanner whose lease
-- ran out) may have had its copy stored without recording it.
-- KEYS: 1 pending index, 2 pending-since index, 3 activity meta
-- ARGV: 1 now_ms, 2 batch, 3 owner, 4 lease_ms, 5 reservation key prefix, 6 retire_after_ms
-- Returns a flat list: reservation_id followed by its hash as field/value pairs, per claim;
-- or {'RETIRE'} when the activity needs no scanner any more: nothing is pending and it ended
-- more than retire_after_ms ago (so no reservation can still appear, even from an API host
-- whose clock lags), or its meta is gone.
local now = tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, rid in ipairs(due) do
  local rk = ARGV[5] .. rid
  local status = redis.call('HGET', rk, 'mq_status')
  if status ~= 'MQ_PENDING' then
    -- Confirmed, failed or gone: nothing left to send.
    redis.call('ZREM', KEYS[1], rid)
    redis.call('ZREM', KEYS[2], rid)
  else
    local until_ms = now + tonumber(ARGV[4])
    redis.call('HINCRBY', rk, 'send_attempt', 1)
    redis.call('HSET', rk, 'lease_owner', ARGV[3], 'lease_until', tostring(until_ms), 'uncertain', '1')
    redis.call('ZADD', KEYS[1], until_ms, rid)
    table.insert(out, rid)
    table.insert(out, redis.call('HGETALL', rk))
  end
end
if #out == 0 and redis.call('ZCARD', KEYS[1]) == 0 then
  local ends = redis.call('HGET', KEYS[3], 'ends_at_ms')
  if (not ends) or now >= tonumber(ends) + tonumber(ARGV[6]) then return {'RETIRE'} end
end
return out
