-- wrk script: POST one SMS per request, rotating over the tenant keys in
-- $KEYS (comma-separated), so several tenants send at once. With
-- IDEMPOTENCY=1 each request carries an Idempotency-Key of its own (the
-- thread's number and a counter), so the accept path claims a key per send.
local keys = {}
for key in string.gmatch(os.getenv("KEYS"), "[^,]+") do
  keys[#keys + 1] = key
end
local keyed = os.getenv("IDEMPOTENCY") == "1"
local threads = 0
-- Told apart across wrk processes (one per instance) by a table's address.
local process = tostring({}):match("0x%x+") or tostring(os.time())
function setup(thread)
  threads = threads + 1
  thread:set("thread_number", threads)
  thread:set("process", process)
end
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"channel":"sms","to":"+15551234567","text":"Your login code is 123456","priority":"high","reference":"bench"}'
request = function()
  n = n + 1
  wrk.headers["Authorization"] = "Bearer " .. keys[(n % #keys) + 1]
  if keyed then
    wrk.headers["Idempotency-Key"] = string.format("bench-%s-%d-%d", process or "", thread_number or 0, n)
  end
  return wrk.format()
end
