-- Token bucket of one caller (a buyer or a client address), shared by every API instance
-- (docs/ARCHITECTURE.md#abuse-limits). The bucket is its own key, hash-tagged by the caller,
-- so the script works on Redis Cluster.
-- KEYS: 1 bucket hash {tokens, ts}
-- ARGV: 1 now_ms, 2 tokens refilled per second, 3 burst (bucket size)
-- Returns {1, 0} when a token was taken, {0, retry_after_ms} when the bucket is empty.
local now = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(b[1])
local ts = tonumber(b[2])
if tokens == nil or ts == nil then
  tokens = burst
  ts = now
end
if now > ts then
  tokens = math.min(burst, tokens + (now - ts) * rate / 1000)
  ts = now
end
local allowed = 0
local retry = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
else
  retry = math.ceil((1 - tokens) * 1000 / rate)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(ts))
-- A full bucket needs no key: it expires once it would have refilled.
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return {allowed, retry}
