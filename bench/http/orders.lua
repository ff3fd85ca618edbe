-- wrk's script for bench/http.sh: POST /orders with a JSON body, each
-- request with a new Idempotency-Key, or all with IDEM_KEY when it is set
-- (the first stores the answer, the rest are replays). It ends with one
-- line: RESULT requests seconds p50_us p99_us non_2xx_3xx socket_errors

local fixed = os.getenv("IDEM_KEY")
if fixed == "" then fixed = nil end
local run = os.getenv("IDEM_RUN") or tostring(os.time())
local body = '{"sku": "bench", "qty": 1}'
local threads = {}

function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end

function init(args)
  counter = 0
  prefix = run .. "-" .. tid .. "-"
end

function request()
  counter = counter + 1
  local key = fixed or (prefix .. counter)
  return wrk.format("POST", "/orders",
    { ["Content-Type"] = "application/json", ["Idempotency-Key"] = key }, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %d %.3f %d %d %d %d\n",
    summary.requests, summary.duration / 1e6,
    latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end
