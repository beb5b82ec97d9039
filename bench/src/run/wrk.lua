-- wrk script for the front door's ceilings (bench/src/run/ceilings.rs). Environment:
--   WRK_METHOD  GET (a bare path, no token) or POST (a reservation)
--   WRK_PATH    the path
--   WRK_TOKENS  a file with one buyer token per line, used in turn (POST)
--   WRK_TAG     prefix of every request_id (a new request_id per request)
-- Prints one line at the end: WRK requests=… per_s=… p50_ms=… p99_ms=… errors=… s<status>=…
local method = os.getenv("WRK_METHOD") or "GET"
local path = os.getenv("WRK_PATH") or "/healthz"
local tag = os.getenv("WRK_TAG") or "wrk"
local tokens = {}
local threads = {}
local n = 0
statuses = {}

local file = os.getenv("WRK_TOKENS")
if method == "POST" and file and file ~= "" then
  for line in io.lines(file) do
    if line ~= "" then tokens[#tokens + 1] = line end
  end
end

function setup(thread)
  thread:set("id", #threads + 1)
  threads[#threads + 1] = thread
end

function request()
  if method ~= "POST" then
    return wrk.format("GET", path)
  end
  n = n + 1
  local headers = { ["Content-Type"] = "application/json" }
  if #tokens > 0 then
    headers["Authorization"] = "Bearer " .. tokens[((n - 1) % #tokens) + 1]
  end
  local body = '{"request_id":"' .. tag .. '-' .. tostring(id) .. '-' .. n .. '","quantity":1}'
  return wrk.format("POST", path, headers, body)
end

function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local counts = {}
  for _, t in ipairs(threads) do
    for status, count in pairs(t:get("statuses")) do
      counts[status] = (counts[status] or 0) + count
    end
  end
  local e = summary.errors
  local secs = summary.duration / 1e6
  io.write(string.format(
    "WRK requests=%d seconds=%.2f per_s=%.0f p50_ms=%.2f p99_ms=%.2f errors=%d",
    summary.requests, secs, summary.requests / secs,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    e.connect + e.read + e.write + e.timeout))
  for status, count in pairs(counts) do
    io.write(string.format(" s%d=%d", status, count))
  end
  io.write("\n")
end
