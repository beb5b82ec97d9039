-- Atomic reservation (docs/architecture/hot-path.md#the-hot-path). All keys share the hash tag of the
-- activity's stock bucket the buyer reserves in (docs/architecture/redis.md#stock-buckets).
-- KEYS: 1 meta, 2 sku, 3 buyers, 4 requests, 5 pending index (by next retry), 6 pending-since index
--       (by creation: its head is the oldest unconfirmed reservation), 7 the client address's
--       rate bucket, 8 the buyer's rate bucket (both within the activity)
-- ARGV: 1 now_ms, 2 user_id, 3 request_id, 4 reservation_id, 5 message_id, 6 order_id,
--       7 sku_id, 8 activity_id, 9 next_retry_at_ms, 10 reservation key prefix,
--       11 traceparent, 12 reservation key ttl seconds, 13 address rate per second,
--       14 address burst, 15 buyer rate per second, 16 buyer burst (a rate of 0: no limit),
--       17 the buyer's sales channel ("" when none), 18 19 the highest (epoch, seq) of this
--       shard the caller has seen (docs/architecture/redis.md#when-redis-forgets)
-- KEYS 9: the SKU's draw (docs/architecture/hot-path.md#a-fair-start): while the activity's fair window
--       is open, a request enters it instead of taking stock, answered DRAW with when it closes;
--       once closed and until draw.lua has drawn every entrant, DRAWING.
-- KEYS 10, ARGV 20: sale passes (docs/architecture/hot-path.md#sale-passes). KEYS[10] maps each buyer of
--       the bucket to the SKU their pass holds; ARGV[20] is the id of the pass the caller
--       verified for this buyer and activity ("" when none). When the activity requires passes,
--       a request without one is PASS_REQUIRED, and a pass holding a live reservation of
--       another SKU is PASS_USED.
-- Returns {code, epoch, seq, ...}: the shard's epoch and reservation sequence, then for OK
-- {reservation_id, message_id, order_id, mq_status, status, valid_until_ms, created_at_ms}
local now = tonumber(ARGV[1])
local meta = redis.call('HMGET', KEYS[1], 'starts_at_ms', 'ends_at_ms', 'valid_ms', 'paused',
  'paused_reason', 'buckets', 'epoch', 'seq', 'suspect', 'resumed_at_ms', 'ramp_ms', 'fair_ms',
  'fair_seed', 'passes')
local epoch, seq = tonumber(meta[7] or '0'), tonumber(meta[8] or '0')
local function out(t)
  table.insert(t, 2, tostring(epoch))
  table.insert(t, 3, tostring(seq))
  return t
end
-- Fenced: this Redis lost writes it had acknowledged, and the activity waits for its rebuild
-- from PostgreSQL. Nothing is answered from state that may be behind, repeats included.
if meta[9] then return out({'FENCED', meta[9]}) end
if not meta[1] then return out({'NOT_FOUND'}) end
-- Every reservation advances the shard's sequence; a caller that saw a later one (or a later
-- epoch: a rebuild's) is looking at Redis after it forgot: fence the shard, here and for all.
local seen_epoch, seen_seq = tonumber(ARGV[18]) or 0, tonumber(ARGV[19]) or 0
if epoch < seen_epoch or (epoch == seen_epoch and seq < seen_seq) then
  local why = string.format('Redis is behind what it answered: epoch %d seq %d, seen epoch %d seq %d',
    epoch, seq, seen_epoch, seen_seq)
  redis.call('HSET', KEYS[1], 'suspect', why, 'suspect_at_ms', ARGV[1])
  return out({'LOST', why})
end

-- Abuse limits (docs/architecture/hot-path.md#abuse-limits): a token bucket per client address and per
-- buyer, taken before anything else, repeats included. Both are read first and written only
-- when both have a token, so a refusal takes nothing.
local function bucket(key, rate, burst)
  if rate <= 0 then return nil, 0 end
  -- One string "<tokens> <ms>": one GET and one SET with its expiry.
  local tokens, ts
  local v = redis.call('GET', key)
  if v then
    local t, m = string.match(v, '^(%S+) (%S+)$')
    tokens, ts = tonumber(t), tonumber(m)
  end
  if tokens == nil or ts == nil then
    tokens = burst
    ts = now
  end
  if now > ts then
    tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
    ts = now
  end
  if tokens < 1 then return nil, math.ceil((1 - tokens) * 1000 / rate) end
  return {tokens - 1, ts, math.ceil(burst * 1000 / rate) + 1000}, 0
end
local ip_rate, ip_burst = tonumber(ARGV[13]) or 0, tonumber(ARGV[14]) or 0
local u_rate, u_burst = tonumber(ARGV[15]) or 0, tonumber(ARGV[16]) or 0
local ip_take, ip_wait = bucket(KEYS[7], ip_rate, ip_burst)
if ip_wait > 0 then return out({'RATE_LIMITED', 'ip', tostring(ip_wait)}) end
local u_take, u_wait = bucket(KEYS[8], u_rate, u_burst)
if u_wait > 0 then return out({'RATE_LIMITED', 'u', tostring(u_wait)}) end
for _, t in ipairs({{KEYS[7], ip_take}, {KEYS[8], u_take}}) do
  if t[2] then
    -- A full bucket needs no key: it expires once it would have refilled.
    redis.call('SET', t[1], string.format('%.17g %.17g', t[2][1], t[2][2]), 'PX', t[2][3])
  end
end

local reqfield = ARGV[2] .. ':' .. ARGV[3]
local existing = redis.call('HGET', KEYS[4], reqfield)
if existing then
  -- The same request again: answer with the same reservation, change nothing. The key is the
  -- buyer's request id within the activity, so the same id on another SKU is not a repeat of
  -- that request: refuse it rather than answer with the other SKU's reservation.
  local h = redis.call('HMGET', ARGV[10] .. existing,
    'message_id', 'order_id', 'mq_status', 'status', 'valid_until', 'created_at', 'sku_id')
  if h[7] and h[7] ~= ARGV[7] then return out({'REQUEST_ID_REUSED', existing, h[7]}) end
  return out({'DUPLICATE_REQUEST', existing, h[1] or '', h[2] or '', h[3] or '', h[4] or '',
          h[5] or '', h[6] or ''})
end
-- An operator's pause, of the whole activity or of this SKU (the admin listener sets it).
if meta[4] == '1' then return out({'PAUSED', meta[5] or ''}) end
if now < tonumber(meta[1]) then return out({'NOT_STARTED'}) end
if now >= tonumber(meta[2]) then return out({'ENDED'}) end
local sku = redis.call('HMGET', KEYS[2], 'remaining', 'paused', 'paused_reason', 'draw_done')
local remaining = sku[1]
if not remaining then return out({'NOT_FOUND'}) end
if sku[2] == '1' then return out({'PAUSED', sku[3] or ''}) end
local holder = redis.call('HGET', KEYS[3], ARGV[2])
if holder then return out({'ALREADY_PURCHASED', holder}) end
-- A pass buys once: it is free again only when the reservation it holds was given back (the
-- buyer is no longer in that SKU's buyers).
local passes = meta[14] == '1'
if passes then
  if (ARGV[20] or '') == '' then return out({'PASS_REQUIRED'}) end
  local held = redis.call('HGET', KEYS[10], ARGV[2])
  if held and held ~= ARGV[7] then
    local other = string.sub(KEYS[3], 1, #KEYS[3] - #ARGV[7]) .. held
    local rid = redis.call('HGET', other, ARGV[2])
    if rid then return out({'PASS_USED', rid, held}) end
  end
end

-- A fair start: from the start until the window closes, every request enters the SKU's draw
-- (one ticket per buyer, its number drawn from the activity's seed and the buyer, so an audit
-- recomputes the order); nothing is taken until draw.lua gives the stock out in ticket order.
-- The request's reservation hash, in the buyer and request indexes: what a reservation and a
-- draw entry share. `fields` are its state's own; returns its key.
local function write_reservation(fields, ttl)
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
  redis.call('HSET', KEYS[4], reqfield, ARGV[4])
  local rk = ARGV[10] .. ARGV[4]
  redis.call('HSET', rk,
    'reservation_id', ARGV[4], 'message_id', ARGV[5], 'order_id', ARGV[6],
    'request_id', ARGV[3], 'req_field', reqfield,
    'activity_id', ARGV[8], 'sku_id', ARGV[7], 'user_id', ARGV[2], 'traceparent', ARGV[11],
    unpack(fields))
  if ARGV[17] and ARGV[17] ~= '' then redis.call('HSET', rk, 'channel', ARGV[17]) end
  if passes then
    redis.call('HSET', KEYS[10], ARGV[2], ARGV[7])
    redis.call('HSET', rk, 'pass_id', ARGV[20])
  end
  redis.call('EXPIRE', rk, ttl)
  return rk
end
local fair_ms = tonumber(meta[12] or '0') or 0
if fair_ms > 0 and sku[4] ~= '1' then
  local closes = tonumber(meta[1]) + fair_ms
  if now >= closes then return out({'DRAWING', tostring(closes)}) end
  local ticket = tonumber(string.sub(redis.sha1hex((meta[13] or '') .. ':' .. ARGV[2]), 1, 13), 16)
  redis.call('ZADD', KEYS[9], ticket, ARGV[2])
  -- Kept until well after the draw: the window, then a reservation's own lifetime.
  write_reservation({'status', 'DRAW_PENDING', 'mq_status', 'DRAW_PENDING', 'send_attempt', '0',
    'entered_at', ARGV[1]}, tonumber(ARGV[12]) + math.ceil((closes - now) / 1000))
  return out({'DRAW', ARGV[4], ARGV[5], ARGV[6], 'DRAW_PENDING', 'DRAW_PENDING',
    tostring(closes), ARGV[1]})
end
if tonumber(remaining) <= 0 then
  -- A split SKU's bucket counts the buyers it refused: the rebalancer moves leftovers from
  -- the other buckets to one that refuses (docs/architecture/redis.md#moving-leftovers).
  if meta[6] and tonumber(meta[6]) > 1 then redis.call('HINCRBY', KEYS[2], 'refused', 1) end
  return out({'SOLD_OUT'})
end

-- Resuming after a rebuild: a share of new reservations growing from 10 % to all over the
-- ramp, spread evenly over arrivals (the same share on every API instance).
if meta[10] then
  local since, ramp = now - tonumber(meta[10]), tonumber(meta[11] or '0')
  if since < ramp then
    local share = 0.1 + 0.9 * since / ramp
    local n = redis.call('HINCRBY', KEYS[1], 'ramp_n', 1) - 1
    if math.floor((n + 1) * share) <= math.floor(n * share) then
      return out({'RAMP', tostring(math.floor(share * 100)), tostring(math.ceil((ramp - since) / 1000))})
    end
  end
end

redis.call('HINCRBY', KEYS[2], 'remaining', -1)
seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
-- Every reservation ever made, never given back: an API instance answering SOLD_OUT from memory
-- sees a unit released and taken again between two of its polls (sold_out_view.lua).
redis.call('HINCRBY', KEYS[2], 'taken', 1)
local valid_until = now + tonumber(meta[3])
write_reservation({'status', 'RESERVED', 'mq_status', 'MQ_PENDING', 'send_attempt', '1',
  'next_retry_at', ARGV[9], 'created_at', ARGV[1], 'valid_until', tostring(valid_until)},
  tonumber(ARGV[12]))
redis.call('ZADD', KEYS[5], tonumber(ARGV[9]), ARGV[4])
redis.call('ZADD', KEYS[6], now, ARGV[4])
return out({'OK', ARGV[4], ARGV[5], ARGV[6], 'MQ_PENDING', 'RESERVED', tostring(valid_until), ARGV[1]})
