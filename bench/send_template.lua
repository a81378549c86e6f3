-- wrk script: POST one email by template per request with the tenant key
-- from $KEY and the template from $TEMPLATE_ID (bench/pipeline.sh with
-- TEMPLATE=1 makes both). Its subject and text render to about the size
-- of bench/send_email.lua's.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("KEY")
wrk.body = '{"channel":"email","to":"someone@example.com","template_id":"' .. os.getenv("TEMPLATE_ID") ..
  '","personalisation":{"name":"Ann","order":"A-1234"},"priority":"normal","reference":"bench"}'
