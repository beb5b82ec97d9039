-- An operator's pause or resume of an activity (its meta hash) or of one SKU
-- (docs/architecture/security.md#admin-surface), only if that hash exists: a pause never creates a
-- half-made activity that reserve.lua would then read.
-- KEYS: 1 the meta or SKU hash. ARGV: 1 '1' to pause, '0' to resume; 2 the reason buyers are told.
-- Returns 1 when the hash exists, 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'paused', '1', 'paused_reason', ARGV[2])
else
  redis.call('HDEL', KEYS[1], 'paused', 'paused_reason')
end
return 1
