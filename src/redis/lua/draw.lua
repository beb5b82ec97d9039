-- The draw of one SKU in one stock bucket once its fair window closed
-- (docs/architecture/hot-path.md#a-fair-start): the entrants in ticket order (reserve.lua numbered them
-- from the activity's seed), the first `remaining` get their reservation exactly as reserve.lua
-- makes one (stock taken, the pending indexes, a fresh validity), the others are told DRAW_LOST
-- and may buy again first come first served. A chunk at a time, from a cursor kept on the SKU,
-- so a large draw never holds Redis long; idempotent: a call after the last chunk changes
-- nothing.
-- KEYS: 1 meta, 2 sku, 3 buyers, 4 the SKU's draw, 5 pending index, 6 pending-since index
-- ARGV: 1 now_ms, 2 reservation key prefix, 3 chunk size, 4 next_retry_at_ms of the winners
--       (when the scanner may send what no waiting request sent), 5 reservation key ttl secs
-- Returns {code, epoch, seq, won, lost, entrants}: code DONE (every entrant drawn), MORE (call
-- again), NOT_CLOSED (the window is still open) or NO_DRAW (the activity has no fair window).
local now = tonumber(ARGV[1])
local meta = redis.call('HMGET', KEYS[1], 'starts_at_ms', 'valid_ms', 'fair_ms', 'epoch', 'seq',
  'suspect')
local epoch, seq = tonumber(meta[4] or '0'), tonumber(meta[5] or '0')
local sku = redis.call('HMGET', KEYS[2], 'remaining', 'draw_done', 'draw_cursor', 'draw_won',
  'draw_lost')
local won, lost = tonumber(sku[4] or '0'), tonumber(sku[5] or '0')
local entrants = redis.call('ZCARD', KEYS[4])
local function out(code)
  return {code, tostring(epoch), tostring(seq), tostring(won), tostring(lost), tostring(entrants)}
end
if meta[6] then return out('FENCED') end
local fair_ms = tonumber(meta[3] or '0') or 0
if not meta[1] or not sku[1] or fair_ms <= 0 then return out('NO_DRAW') end
if sku[2] == '1' then return out('DONE') end
if now < tonumber(meta[1]) + fair_ms then return out('NOT_CLOSED') end

local cursor = tonumber(sku[3] or '0')
local chunk = tonumber(ARGV[3])
local remaining = tonumber(sku[1])
local valid_until = now + tonumber(meta[2])
local users = redis.call('ZRANGE', KEYS[4], cursor, cursor + chunk - 1)
for _, user in ipairs(users) do
  local rid = redis.call('HGET', KEYS[3], user)
  local rk = rid and (ARGV[2] .. rid)
  if rid and redis.call('HGET', rk, 'status') == 'DRAW_PENDING' then
    if remaining > 0 then
      remaining = remaining - 1
      seq = seq + 1
      redis.call('HINCRBY', KEYS[2], 'taken', 1)
      redis.call('HSET', rk, 'status', 'RESERVED', 'mq_status', 'MQ_PENDING', 'send_attempt', '1',
        'next_retry_at', ARGV[4], 'created_at', ARGV[1], 'valid_until', tostring(valid_until))
      redis.call('EXPIRE', rk, tonumber(ARGV[5]))
      redis.call('ZADD', KEYS[5], tonumber(ARGV[4]), rid)
      redis.call('ZADD', KEYS[6], now, rid)
      won = won + 1
    else
      redis.call('HSET', rk, 'status', 'DRAW_LOST', 'mq_status', 'DRAW_LOST', 'drawn_at', ARGV[1])
      -- Free to buy again, first come first served, should a unit come back.
      redis.call('HDEL', KEYS[3], user)
      lost = lost + 1
    end
  end
end
cursor = cursor + #users
redis.call('HSET', KEYS[2], 'remaining', tostring(remaining), 'draw_cursor', tostring(cursor),
  'draw_won', tostring(won), 'draw_lost', tostring(lost))
redis.call('HSET', KEYS[1], 'seq', tostring(seq))
if cursor >= entrants then
  redis.call('HSET', KEYS[2], 'draw_done', '1', 'draw_done_at_ms', ARGV[1])
  return out('DONE')
end
return out('MORE')
