-- What an API instance that answers SOLD_OUT from memory needs of one SKU
-- (docs/architecture/hot-path.md#sold-out-from-memory): its remaining stock and its `taken` counter (every
-- reservation ever made, never decremented), and its winners (the buyers holding a
-- reservation) when `taken` is not the one the caller already knows. One call, so the winners
-- are exactly those of that `taken`.
-- Returns {remaining, taken, user_id...}; no user ids when taken is the known one or stock is back.
local K = {
  sku = KEYS[1],
  buyers = KEYS[2],
}
local A = {
  known_taken = ARGV[1],    -- the taken the caller knows (-1: none)
}
local v = redis.call('HMGET', K.sku, 'remaining', 'taken')
-- The SKU is gone (its activity retired and its keys expired): not known sold out any more.
if not v[1] then return {1, 0} end
local remaining = tonumber(v[1]) or 0
local taken = tonumber(v[2]) or 0
if remaining > 0 or taken == tonumber(A.known_taken) then return {remaining, taken} end
local out = {remaining, taken}
for _, u in ipairs(redis.call('HKEYS', K.buyers)) do table.insert(out, tonumber(u)) end
return out
