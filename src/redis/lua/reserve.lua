-- Atomic reservation (docs/architecture/hot-path.md#the-hot-path). All keys share the hash tag of the
-- activity's stock bucket the buyer reserves in (docs/architecture/redis.md#stock-buckets).
-- Returns {code, epoch, seq, ...}: the shard's epoch and reservation sequence, then for OK
-- {reservation_id, message_id, order_id, mq_status, status, valid_until_ms, created_at_ms}
local K = {
  meta = KEYS[1],
  sku = KEYS[2],
  buyers = KEYS[3],
  requests = KEYS[4],
  pending = KEYS[5],          -- the pending index (by next retry)
  pending_since = KEYS[6],    -- the pending-since index (by creation: its head is the oldest
                              -- unconfirmed reservation)
  address_rate = KEYS[7],     -- the client address's rate bucket (within the activity)
  buyer_rate = KEYS[8],       -- the buyer's rate bucket (within the activity)
  draw = KEYS[9],             -- the SKU's draw (a fair start)
  passes = KEYS[10],          -- each buyer of the bucket to the SKU their pass holds (sale passes)
}
local A = {
  now_ms = ARGV[1],
  user_id = ARGV[2],
  request_id = ARGV[3],
  reservation_id = ARGV[4],
  message_id = ARGV[5],
  order_id = ARGV[6],
  sku_id = ARGV[7],
  activity_id = ARGV[8],
  next_retry_at_ms = ARGV[9],
  reservation_prefix = ARGV[10],     -- the reservation key prefix
  traceparent = ARGV[11],
  reservation_ttl_secs = ARGV[12],
  address_rate = ARGV[13],           -- per second, 0: no limit
  address_burst = ARGV[14],
  buyer_rate = ARGV[15],             -- per second, 0: no limit
  buyer_burst = ARGV[16],
  channel = ARGV[17],                -- the buyer's sales channel ('' when none)
  seen_epoch = ARGV[18],             -- the highest (epoch, seq) of this shard the caller has seen
  seen_seq = ARGV[19],
  pass_id = ARGV[20],                -- the pass the caller verified for this buyer and activity
                                     -- ('' when none)
  buyers_prefix = ARGV[21],          -- another SKU's buyers key of this bucket is this and its sku_id
}
local now = tonumber(A.now_ms)
local meta = redis.call('HMGET', K.meta, 'starts_at_ms', 'ends_at_ms', 'valid_ms', 'paused',
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
local seen_epoch, seen_seq = tonumber(A.seen_epoch) or 0, tonumber(A.seen_seq) or 0
if epoch < seen_epoch or (epoch == seen_epoch and seq < seen_seq) then
  local why = string.format('Redis is behind what it answered: epoch %d seq %d, seen epoch %d seq %d',
    epoch, seq, seen_epoch, seen_seq)
  redis.call('HSET', K.meta, 'suspect', why, 'suspect_at_ms', A.now_ms)
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
local ip_rate, ip_burst = tonumber(A.address_rate) or 0, tonumber(A.address_burst) or 0
local u_rate, u_burst = tonumber(A.buyer_rate) or 0, tonumber(A.buyer_burst) or 0
local ip_take, ip_wait = bucket(K.address_rate, ip_rate, ip_burst)
if ip_wait > 0 then return out({'RATE_LIMITED', 'ip', tostring(ip_wait)}) end
local u_take, u_wait = bucket(K.buyer_rate, u_rate, u_burst)
if u_wait > 0 then return out({'RATE_LIMITED', 'u', tostring(u_wait)}) end
for _, t in ipairs({{K.address_rate, ip_take}, {K.buyer_rate, u_take}}) do
  if t[2] then
    -- A full bucket needs no key: it expires once it would have refilled.
    redis.call('SET', t[1], string.format('%.17g %.17g', t[2][1], t[2][2]), 'PX', t[2][3])
  end
end

local reqfield = A.user_id .. ':' .. A.request_id
local existing = redis.call('HGET', K.requests, reqfield)
if existing then
  -- The same request again: answer with the same reservation, change nothing. The key is the
  -- buyer's request id within the activity, so the same id on another SKU is not a repeat of
  -- that request: refuse it rather than answer with the other SKU's reservation.
  local h = redis.call('HMGET', A.reservation_prefix .. existing,
    'message_id', 'order_id', 'mq_status', 'status', 'valid_until', 'created_at', 'sku_id')
  if h[7] and h[7] ~= A.sku_id then return out({'REQUEST_ID_REUSED', existing, h[7]}) end
  return out({'DUPLICATE_REQUEST', existing, h[1] or '', h[2] or '', h[3] or '', h[4] or '',
          h[5] or '', h[6] or ''})
end
-- An operator's pause, of the whole activity or of this SKU (the admin listener sets it).
if meta[4] == '1' then return out({'PAUSED', meta[5] or ''}) end
if now < tonumber(meta[1]) then return out({'NOT_STARTED'}) end
if now >= tonumber(meta[2]) then return out({'ENDED'}) end
local sku = redis.call('HMGET', K.sku, 'remaining', 'paused', 'paused_reason', 'draw_done')
local remaining = sku[1]
if not remaining then return out({'NOT_FOUND'}) end
if sku[2] == '1' then return out({'PAUSED', sku[3] or ''}) end
local holder = redis.call('HGET', K.buyers, A.user_id)
if holder then return out({'ALREADY_PURCHASED', holder}) end
-- Sale passes (docs/architecture/hot-path.md#sale-passes): when the activity requires them, a
-- request without one is PASS_REQUIRED, and a pass holding a live reservation of another SKU
-- is PASS_USED. A pass buys once: it is free again only when the reservation it holds was
-- given back (the buyer is no longer in that SKU's buyers).
local passes = meta[14] == '1'
if passes then
  if (A.pass_id or '') == '' then return out({'PASS_REQUIRED'}) end
  local held = redis.call('HGET', K.passes, A.user_id)
  if held and held ~= A.sku_id then
    local other = A.buyers_prefix .. held
    local rid = redis.call('HGET', other, A.user_id)
    if rid then return out({'PASS_USED', rid, held}) end
  end
end

-- A fair start (docs/architecture/hot-path.md#a-fair-start): from the start until the window
-- closes, every request enters the SKU's draw (one ticket per buyer, its number drawn from the
-- activity's seed and the buyer, so an audit recomputes the order), answered DRAW with when
-- it closes; once closed and until draw.lua has drawn every entrant, DRAWING. Nothing is
-- taken until draw.lua gives the stock out in ticket order.
-- The request's reservation hash, in the buyer and request indexes: what a reservation and a
-- draw entry share. `fields` are its state's own; returns its key.
local function write_reservation(fields, ttl)
  redis.call('HSET', K.buyers, A.user_id, A.reservation_id)
  redis.call('HSET', K.requests, reqfield, A.reservation_id)
  local rk = A.reservation_prefix .. A.reservation_id
  redis.call('HSET', rk,
    'reservation_id', A.reservation_id, 'message_id', A.message_id, 'order_id', A.order_id,
    'request_id', A.request_id, 'req_field', reqfield,
    'activity_id', A.activity_id, 'sku_id', A.sku_id, 'user_id', A.user_id, 'traceparent', A.traceparent,
    unpack(fields))
  if A.channel and A.channel ~= '' then redis.call('HSET', rk, 'channel', A.channel) end
  if passes then
    redis.call('HSET', K.passes, A.user_id, A.sku_id)
    redis.call('HSET', rk, 'pass_id', A.pass_id)
  end
  redis.call('EXPIRE', rk, ttl)
  return rk
end
local fair_ms = tonumber(meta[12] or '0') or 0
if fair_ms > 0 and sku[4] ~= '1' then
  local closes = tonumber(meta[1]) + fair_ms
  if now >= closes then return out({'DRAWING', tostring(closes)}) end
  local ticket = tonumber(string.sub(redis.sha1hex((meta[13] or '') .. ':' .. A.user_id), 1, 13), 16)
  redis.call('ZADD', K.draw, ticket, A.user_id)
  -- Kept until well after the draw: the window, then a reservation's own lifetime.
  write_reservation({'status', 'DRAW_PENDING', 'mq_status', 'DRAW_PENDING', 'send_attempt', '0',
    'entered_at', A.now_ms}, tonumber(A.reservation_ttl_secs) + math.ceil((closes - now) / 1000))
  return out({'DRAW', A.reservation_id, A.message_id, A.order_id, 'DRAW_PENDING', 'DRAW_PENDING',
    tostring(closes), A.now_ms})
end
if tonumber(remaining) <= 0 then
  -- A split SKU's bucket counts the buyers it refused: the rebalancer moves leftovers from
  -- the other buckets to one that refuses (docs/architecture/redis.md#moving-leftovers).
  if meta[6] and tonumber(meta[6]) > 1 then redis.call('HINCRBY', K.sku, 'refused', 1) end
  return out({'SOLD_OUT'})
end

-- Resuming after a rebuild: a share of new reservations growing from 10 % to all over the
-- ramp, spread evenly over arrivals (the same share on every API instance).
if meta[10] then
  local since, ramp = now - tonumber(meta[10]), tonumber(meta[11] or '0')
  if since < ramp then
    local share = 0.1 + 0.9 * since / ramp
    local n = redis.call('HINCRBY', K.meta, 'ramp_n', 1) - 1
    if math.floor((n + 1) * share) <= math.floor(n * share) then
      return out({'RAMP', tostring(math.floor(share * 100)), tostring(math.ceil((ramp - since) / 1000))})
    end
  end
end

redis.call('HINCRBY', K.sku, 'remaining', -1)
seq = redis.call('HINCRBY', K.meta, 'seq', 1)
-- Every reservation ever made, never given back: an API instance answering SOLD_OUT from memory
-- sees a unit released and taken again between two of its polls (sold_out_view.lua).
redis.call('HINCRBY', K.sku, 'taken', 1)
local valid_until = now + tonumber(meta[3])
write_reservation({'status', 'RESERVED', 'mq_status', 'MQ_PENDING', 'send_attempt', '1',
  'next_retry_at', A.next_retry_at_ms, 'created_at', A.now_ms, 'valid_until', tostring(valid_until)},
  tonumber(A.reservation_ttl_secs))
redis.call('ZADD', K.pending, tonumber(A.next_retry_at_ms), A.reservation_id)
redis.call('ZADD', K.pending_since, now, A.reservation_id)
return out({'OK', A.reservation_id, A.message_id, A.order_id, 'MQ_PENDING', 'RESERVED', tostring(valid_until), A.now_ms})
