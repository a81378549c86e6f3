-- wrk script: POST one SMS per request, rotating over the tenant keys in
-- $KEYS (comma-separated), so several tenants send at once.
local keys = {}
for key in string.gmatch(os.getenv("KEYS"), "[^,]+") do
  keys[#keys + 1] = key
end
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"channel":"sms","to":"+15551234567","text":"Your login code is 123456","priority":"high","reference":"bench"}'
request = function()
  n = n + 1
  wrk.headers["Authorization"] = "Bearer " .. keys[(n % #keys) + 1]
  return wrk.format()
end
