-- wrk script: POST one SMS per request with the tenant key from $KEY.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("KEY")
wrk.body = '{"channel":"sms","to":"+15551234567","text":"Your login code is 123456","priority":"high","reference":"bench"}'
