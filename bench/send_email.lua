-- wrk script: POST one email per request with the tenant key from $KEY.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("KEY")
wrk.body = '{"channel":"email","to":"someone@example.com","subject":"Your receipt","text":"Thank you for your order.","priority":"normal","reference":"bench"}'
