-- Scanner claim (docs/architecture/redis.md#pending-index-and-leases): takes up to A.batch due reservations from the pending index and
-- leases them to one scanner: the score moves to the lease expiry, so no other scanner sees
-- them until the lease runs out (a crashed scanner's work comes back by itself). A claimed
-- reservation is marked uncertain: whoever sent it before (the API, or a scanner whose lease
-- ran out) may have had its copy stored without recording it.
-- Returns a flat list: reservation_id followed by its hash as field/value pairs, per claim;
-- or {'RETIRE'} when the activity needs no scanner any more: nothing is pending and it ended
-- more than retire_after_ms ago (so no reservation can still appear, even from an API host
-- whose clock lags), or its meta is gone.
local K = {
  pending = KEYS[1],          -- the pending index
  pending_since = KEYS[2],    -- the pending-since index
  meta = KEYS[3],             -- the activity meta
}
local A = {
  now_ms = ARGV[1],
  batch = ARGV[2],                 -- how many to claim at most
  owner = ARGV[3],                 -- the claiming scanner
  lease_ms = ARGV[4],
  reservation_prefix = ARGV[5],    -- the reservation key prefix
  retire_after_ms = ARGV[6],
}
local now = tonumber(A.now_ms)
local due = redis.call('ZRANGEBYSCORE', K.pending, '-inf', now, 'LIMIT', 0, tonumber(A.batch))
local out = {}
for _, rid in ipairs(due) do
  local rk = A.reservation_prefix .. rid
  local status = redis.call('HGET', rk, 'mq_status')
  if status ~= 'MQ_PENDING' then
    -- Confirmed, failed or gone: nothing left to send.
    redis.call('ZREM', K.pending, rid)
    redis.call('ZREM', K.pending_since, rid)
  else
    local until_ms = now + tonumber(A.lease_ms)
    redis.call('HINCRBY', rk, 'send_attempt', 1)
    redis.call('HSET', rk, 'lease_owner', A.owner, 'lease_until', tostring(until_ms), 'uncertain', '1')
    redis.call('ZADD', K.pending, until_ms, rid)
    table.insert(out, rid)
    table.insert(out, redis.call('HGETALL', rk))
  end
end
if #out == 0 and redis.call('ZCARD', K.pending) == 0 then
  local ends = redis.call('HGET', K.meta, 'ends_at_ms')
  if (not ends) or now >= tonumber(ends) + tonumber(A.retire_after_ms) then return {'RETIRE'} end
end
return out
