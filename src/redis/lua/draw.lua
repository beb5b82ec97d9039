-- The draw of one SKU in one stock bucket once its fair window closed
-- (docs/architecture/hot-path.md#a-fair-start): the entrants in ticket order (reserve.lua numbered them
-- from the activity's seed), the first `remaining` get their reservation exactly as reserve.lua
-- makes one (stock taken, the pending indexes, a fresh validity), the others are told DRAW_LOST
-- and may buy again first come first served. A chunk at a time, from a cursor kept on the SKU,
-- so a large draw never holds Redis long; idempotent: a call after the last chunk changes
-- nothing.
-- Returns {code, epoch, seq, won, lost, entrants}: code DONE (every entrant drawn), MORE (call
-- again), NOT_CLOSED (the window is still open) or NO_DRAW (the activity has no fair window).
local K = {
  meta = KEYS[1],
  sku = KEYS[2],
  buyers = KEYS[3],
  draw = KEYS[4],             -- the SKU's draw
  pending = KEYS[5],          -- the pending index
  pending_since = KEYS[6],    -- the pending-since index
}
local A = {
  now_ms = ARGV[1],
  reservation_prefix = ARGV[2],      -- the reservation key prefix
  chunk = ARGV[3],                   -- entrants drawn per call
  next_retry_at_ms = ARGV[4],        -- when the scanner may send what no waiting request sent
  reservation_ttl_secs = ARGV[5],
}
local now = tonumber(A.now_ms)
local meta = redis.call('HMGET', K.meta, 'starts_at_ms', 'valid_ms', 'fair_ms', 'epoch', 'seq',
  'suspect')
local epoch, seq = tonumber(meta[4] or '0'), tonumber(meta[5] or '0')
local sku = redis.call('HMGET', K.sku, 'remaining', 'draw_done', 'draw_cursor', 'draw_won',
  'draw_lost')
local won, lost = tonumber(sku[4] or '0'), tonumber(sku[5] or '0')
local entrants = redis.call('ZCARD', K.draw)
local function out(code)
  return {code, tostring(epoch), tostring(seq), tostring(won), tostring(lost), tostring(entrants)}
end
if meta[6] then return out('FENCED') end
local fair_ms = tonumber(meta[3] or '0') or 0
if not meta[1] or not sku[1] or fair_ms <= 0 then return out('NO_DRAW') end
if sku[2] == '1' then return out('DONE') end
if now < tonumber(meta[1]) + fair_ms then return out('NOT_CLOSED') end

local cursor = tonumber(sku[3] or '0')
local chunk = tonumber(A.chunk)
local remaining = tonumber(sku[1])
local valid_until = now + tonumber(meta[2])
local users = redis.call('ZRANGE', K.draw, cursor, cursor + chunk - 1)
for _, user in ipairs(users) do
  local rid = redis.call('HGET', K.buyers, user)
  local rk = rid and (A.reservation_prefix .. rid)
  if rid and redis.call('HGET', rk, 'status') == 'DRAW_PENDING' then
    if remaining > 0 then
      remaining = remaining - 1
      seq = seq + 1
      redis.call('HINCRBY', K.sku, 'taken', 1)
      redis.call('HSET', rk, 'status', 'RESERVED', 'mq_status', 'MQ_PENDING', 'send_attempt', '1',
        'next_retry_at', A.next_retry_at_ms, 'created_at', A.now_ms, 'valid_until', tostring(valid_until))
      redis.call('EXPIRE', rk, tonumber(A.reservation_ttl_secs))
      redis.call('ZADD', K.pending, tonumber(A.next_retry_at_ms), rid)
      redis.call('ZADD', K.pending_since, now, rid)
      won = won + 1
    else
      redis.call('HSET', rk, 'status', 'DRAW_LOST', 'mq_status', 'DRAW_LOST', 'drawn_at', A.now_ms)
      -- Free to buy again, first come first served, should a unit come back.
      redis.call('HDEL', K.buyers, user)
      lost = lost + 1
    end
  end
end
cursor = cursor + #users
redis.call('HSET', K.sku, 'remaining', tostring(remaining), 'draw_cursor', tostring(cursor),
  'draw_won', tostring(won), 'draw_lost', tostring(lost))
redis.call('HSET', K.meta, 'seq', tostring(seq))
if cursor >= entrants then
  redis.call('HSET', K.sku, 'draw_done', '1', 'draw_done_at_ms', A.now_ms)
  return out('DONE')
end
return out('MORE')
