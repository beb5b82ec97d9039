-- An operator's pause or resume of an activity (its meta hash) or of one SKU
-- (docs/architecture/security.md#admin-surface), only if that hash exists: a pause never creates a
-- half-made activity that reserve.lua would then read.
-- Returns 1 when the hash exists, 0 otherwise.
local K = {
  hash = KEYS[1],    -- the meta or SKU hash
}
local A = {
  paused = ARGV[1],    -- '1' to pause, '0' to resume
  reason = ARGV[2],    -- the reason buyers are told
}
if redis.call('EXISTS', K.hash) == 0 then return 0 end
if A.paused == '1' then
  redis.call('HSET', K.hash, 'paused', '1', 'paused_reason', A.reason)
else
  redis.call('HDEL', K.hash, 'paused', 'paused_reason')
end
return 1
