//! The operator console in a real browser: Debian's Chromium, headless,
//! driven through ChromeDriver (WebDriver), which the test support starts
//! (`servers::webdriver_url`). An operator signs in, finds a message by
//! its reference, reads its timeline and redrives its dead letter; a
//! viewer sees no button that changes anything, and a form posted without
//! the session's CSRF token, or by a viewer, is refused.
//!
//! The browser does not run beside the tests that measure timings
//! (`support::TIMED`).
//!
//! With `FAIRLANE_CONSOLE_SCREENSHOTS=DIR`, the pages are saved there as
//! PNG files.

use fantoccini::{Client, ClientBuilder, Locator};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::delivery::{SMS_PATH, delivery_settings, mock_sms_ok, status_is, wait_for};
use crate::servers::webdriver_url;
use crate::support::{ADMIN_TOKEN, TestApp, expect_json, on_both_stores, sms, with};

/// A headless Chromium, `width` pixels wide.
async fn browser(width: u32) -> Client {
    // A window is at least 500 px wide even headless: a narrower page is
    // a phone's, emulated.
    let mut options = json!({"args": [
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ]});
    if width < 500 {
        options["mobileEmulation"] =
            json!({"deviceMetrics": {"width": width, "height": 800, "pixelRatio": 1.0}});
    }
    let mut caps = serde_json::Map::new();
    caps.insert("goog:chromeOptions".into(), options);
    ClientBuilder::rustls()
        .expect("a WebDriver client")
        .capabilities(caps)
        .connect(&webdriver_url())
        .await
        .unwrap_or_else(|err| {
            panic!(
                "ChromeDriver at {} did not start a browser: {err}",
                webdriver_url()
            )
        })
}

/// Saves the page as `name.png` when `FAIRLANE_CONSOLE_SCREENSHOTS` is set.
async fn screenshot(browser: &Client, name: &str) {
    if let Ok(dir) = std::env::var("FAIRLANE_CONSOLE_SCREENSHOTS") {
        let png = browser.screenshot().await.expect("a screenshot");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(format!("{dir}/{name}.png"), png).unwrap();
    }
}

/// Signs `browser` in with `token`.
async fn sign_in(browser: &Client, app: &TestApp, token: &str) {
    browser.goto(&app.url("/console")).await.unwrap();
    assert!(
        browser
            .current_url()
            .await
            .unwrap()
            .path()
            .ends_with("/console/login"),
        "a browser without a session is sent to the sign-in page"
    );
    browser
        .find(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(token)
        .await
        .unwrap();
    browser
        .find(Locator::Css("main button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    arrive(browser, "/console").await;
}

/// Waits (up to 10 s) until `browser` shows the page at `path`.
async fn arrive(browser: &Client, path: &str) {
    let mut at = String::new();
    for _ in 0..200 {
        at = browser.current_url().await.unwrap().path().to_owned();
        if at == path {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the browser is at {at}, not {path}");
}

/// Runs axe-core in the page `browser` shows (`what` names it); fails on
/// any serious or critical violation, naming each with its elements.
async fn accessible(browser: &Client, what: &str) {
    browser
        .execute(&crate::servers::axe_source(), vec![])
        .await
        .expect("axe-core loads in the page");
    let found = browser
        .execute_async(
            r#"const done = arguments[arguments.length - 1];
            axe.run(document, {resultTypes: ['violations']}).then(
              (result) => done(result.violations
                .filter((v) => v.impact === 'serious' || v.impact === 'critical')
                .map((v) => ({id: v.id, impact: v.impact, help: v.help,
                              nodes: v.nodes.map((n) => n.target.join(' '))}))),
              (error) => done({error: String(error)}));"#,
            vec![],
        )
        .await
        .expect("axe-core runs");
    assert_eq!(found, json!([]), "axe-core on {what}: {found:#}");
}

/// No table box on the page is wider than the page lets it be: what it
/// shows is not cut off at first sight (issue 68.6).
async fn fits(browser: &Client, what: &str) {
    let wide = browser
        .execute(
            r#"return [...document.querySelectorAll('.box')]
                .filter((box) => box.scrollWidth > box.clientWidth + 1)
                .map((box) => (box.querySelector('caption, th') || box).textContent.trim()
                    + ': ' + box.scrollWidth + ' px in ' + box.clientWidth);"#,
            vec![],
        )
        .await
        .expect("the boxes are measured");
    assert_eq!(wide, json!([]), "tables cut off on {what}: {wide:#}");
}

/// Every console page an operator reaches, with `id` a message of tenant
/// `acme` (dead-lettered, so every page has rows), at `width` px: axe-core
/// finds no serious or critical violation on any (issue 68.6).
async fn every_page_is_accessible(app: &TestApp, width: u32, id: &str) {
    let browser = browser(width).await;
    browser.goto(&app.url("/console/login")).await.unwrap();
    accessible(&browser, &format!("/console/login at {width} px")).await;
    sign_in(&browser, app, ADMIN_TOKEN).await;
    for path in [
        "/console".to_owned(),
        "/console/tenants".to_owned(),
        "/console/tenants/acme".to_owned(),
        "/console/plans".to_owned(),
        "/console/messages?tenant=acme&reference=order-42".to_owned(),
        format!("/console/messages/{id}"),
        "/console/dlq?tenant=acme".to_owned(),
        "/console/webhooks".to_owned(),
        "/console/providers".to_owned(),
        "/console/audit".to_owned(),
    ] {
        browser.goto(&app.url(&path)).await.unwrap();
        accessible(&browser, &format!("{path} at {width} px")).await;
        fits(&browser, &format!("{path} at {width} px")).await;
    }
    browser.close().await.unwrap();
}

async fn text(browser: &Client) -> String {
    browser
        .find(Locator::Css("main"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A session cookie for `token`, signed in over plain HTTP; and the CSRF
/// token its pages carry.
pub(crate) async fn session_of(app: &TestApp, token: &str) -> (String, String) {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let answer = client
        .post(app.url("/console/login"))
        .form(&[("token", token)])
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SEE_OTHER);
    let cookie = answer.headers()["set-cookie"].to_str().unwrap().to_owned();
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console"] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let page = client
        .get(app.url("/console/tenants"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a CSRF field on the page")
        .to_owned();
    (cookie, csrf)
}

/// Posts the console form `path` with `cookie`; the status.
async fn post_form(app: &TestApp, cookie: &str, path: &str, form: &[(&str, &str)]) -> StatusCode {
    form_answer(app, cookie, path, form).await.0
}

on_both_stores! {
    async fn an_operator_finds_a_message_reads_its_timeline_and_redrives_it_a_viewer_only_looks() {
        // Chromium would slow the tests that measure timings (`TIMED`).
        let _alone = crate::support::TIMED.write().await;
        let sms_api = MockServer::start().await;
        let refusal = Mock::given(method("POST"))
            .and(path(SMS_PATH))
            .respond_with(ResponseTemplate::new(400).set_body_json(json!({"code": 21211, "message": "not valid"})))
            .mount_as_scoped(&sms_api)
            .await;
        let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;

        // The operator makes a plan, a tenant on it and a live key, all in
        // the console.
        let operator = browser(1280).await;
        sign_in(&operator, &app, ADMIN_TOKEN).await;
        operator.goto(&app.url("/console/plans")).await.unwrap();
        for (field, value) in [("plan-name", "console"), ("plan-rate", "50"), ("plan-burst", "10"),
            ("plan-quota", "1000"), ("plan-in-flight", "4")] {
            operator.find(Locator::Id(field)).await.unwrap().send_keys(value).await.unwrap();
        }
        operator.find(Locator::Css("form[action='/console/plans'] button")).await.unwrap().click().await.unwrap();
        // The form posts to the page it is on: the plan's row, not the
        // address, says the answer has arrived (a navigation started
        // before it would race the form's).
        operator
            .wait()
            .for_element(Locator::XPath("//tbody//th[normalize-space()='console']"))
            .await
            .unwrap();
        operator.goto(&app.url("/console/tenants")).await.unwrap();
        operator.find(Locator::Id("new-id")).await.unwrap().send_keys("acme").await.unwrap();
        operator.find(Locator::Id("new-name")).await.unwrap().send_keys("Acme Ltd").await.unwrap();
        operator.find(Locator::Css("#new-plan option[value='console']")).await.unwrap().click().await.unwrap();
        operator.find(Locator::Css("form[action='/console/tenants'] button")).await.unwrap().click().await.unwrap();
        arrive(&operator, "/console/tenants/acme").await;
        operator.find(Locator::Css("form[action='/console/tenants/acme/keys'] button")).await.unwrap().click().await.unwrap();
        let key = operator
            .wait()
            .for_element(Locator::Id("issued-key"))
            .await
            .unwrap()
            .prop("value")
            .await
            .unwrap()
            .expect("the issued key is shown");
        assert!(key.starts_with("fl_"), "{key}");
        accessible(&operator, "the page of an issued key").await;

        let id = app.send_accepted(&key, &with(sms(), "reference", json!("order-42"))).await;
        wait_for(&app, &key, &id, status_is("dead_lettered")).await;
        // The key's page shows its use.
        operator.goto(&app.url("/console/tenants/acme")).await.unwrap();
        let tenant_page = text(&operator).await;
        assert!(tenant_page.contains("console") && tenant_page.contains("Acme Ltd"), "{tenant_page}");
        assert!(!tenant_page.contains("never"), "the key was used: {tenant_page}");
        screenshot(&operator, "tenant").await;

        operator.goto(&app.url("/console")).await.unwrap();
        let overview = text(&operator).await;
        assert!(overview.contains("acme") && overview.contains("Lanes"), "{overview}");
        screenshot(&operator, "overview").await;

        // Search by reference, then the message's timeline.
        operator.goto(&app.url("/console/messages")).await.unwrap();
        operator.find(Locator::Id("tenant")).await.unwrap().send_keys("acme").await.unwrap();
        operator.find(Locator::Id("reference")).await.unwrap().send_keys("order-42").await.unwrap();
        operator.find(Locator::Css("form[role=search] button")).await.unwrap().click().await.unwrap();
        screenshot(&operator, "search").await;
        operator.wait().for_element(Locator::LinkText(&id)).await.unwrap().click().await.unwrap();
        arrive(&operator, &format!("/console/messages/{id}")).await;
        let timeline = text(&operator).await;
        assert!(timeline.contains("Timeline") && timeline.contains("dead_lettered"), "{timeline}");
        assert!(timeline.contains("21211"), "the provider's refusal is on the timeline: {timeline}");
        screenshot(&operator, "timeline").await;
        for width in [1280, 375] {
            every_page_is_accessible(&app, width, &id).await;
        }

        // The provider recovers; the operator redrives the dead letter.
        drop(refusal);
        mock_sms_ok(&sms_api, "SM-console").await;
        operator.goto(&app.url("/console/dlq?tenant=acme")).await.unwrap();
        operator.find(Locator::Css(&format!("input[type=checkbox][value='{id}']"))).await.unwrap().click().await.unwrap();
        operator
            .find(Locator::Css("main form[action='/console/dlq/redrive'] button[value=selected]"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        arrive(&operator, "/console/dlq").await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        // The redrive is on the timeline, and both provider calls are
        // counted; the overview counts the message once, as sent, and the
        // usage says why (issue 68.6).
        operator.goto(&app.url(&format!("/console/messages/{id}"))).await.unwrap();
        let timeline = text(&operator).await;
        assert!(timeline.contains("redriven: back in its lane"), "{timeline}");
        assert!(timeline.contains("1 since its last redrive; 2 in all, over 1 redrive"), "{timeline}");
        operator.goto(&app.url("/console")).await.unwrap();
        let today = operator
            .execute(
                r#"const row = [...document.querySelectorAll('tbody tr')]
                    .find((r) => r.querySelector('th')?.textContent.trim() === 'acme');
                return [...row.querySelectorAll('td')].slice(6, 9).map((td) => td.textContent.trim());"#,
                vec![],
            )
            .await
            .unwrap();
        assert_eq!(today, json!(["1", "0", "0"]), "acme's sent, delivered and failed today");
        let usage = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/usage").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let sms_total = &usage["totals"][0];
        assert_eq!(
            (&sms_total["dead_lettered"], &sms_total["redriven"], &sms_total["sent"]),
            (&json!(1), &json!(1), &json!(1)),
            "{usage}"
        );
        let log = expect_json(
            app.admin(Method::GET, "/v1/admin/audit?action=POST%20/console/").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let entries = log["entries"].as_array().unwrap();
        let actions: Vec<&str> = entries.iter().map(|entry| entry["action"].as_str().unwrap()).collect();
        // Newest first.
        assert_eq!(actions, ["POST /console/dlq/redrive", "POST /console/tenants/{id}/keys",
            "POST /console/tenants", "POST /console/plans"], "{log}");
        assert!(entries.iter().all(|entry| entry["actor"]["name"] == "root"), "{log}");
        assert_eq!(entries[0]["after"]["redriven"], 1);
        assert_eq!(entries[0]["after"]["ids"], json!([id]), "the selected dead letter");
        assert_eq!(entries[1]["after"]["kind"], "live");
        // The targets are the API's names of what changed, so a search by
        // the tenant finds its changes made in the console (issue 68.6).
        let targets: Vec<&str> = entries.iter().map(|entry| entry["target"].as_str().unwrap()).collect();
        assert_eq!(targets, ["/v1/admin/dlq/redrive", "/v1/admin/tenants/acme/keys",
            "/v1/admin/tenants/acme", "/v1/admin/plans/console"], "{log}");
        let of_acme = expect_json(
            app.admin(Method::GET, "/v1/admin/audit?target=/v1/admin/tenants/acme").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let of_acme: Vec<&str> = of_acme["entries"].as_array().unwrap().iter().map(|entry| entry["action"].as_str().unwrap()).collect();
        assert!(of_acme.contains(&"POST /console/tenants"), "{of_acme:?}");
        assert!(!log.to_string().contains(&key), "the key is not in the log");
        assert_eq!(entries[2]["after"]["plan"], "console");
        assert_eq!(entries[3]["after"]["burst"], 10);
        operator.close().await.unwrap();

        // A viewer: the pages, no button that changes anything.
        let added = app
            .admin(Method::POST, "/v1/admin/admins")
            .json(&json!({"name": "desk", "role": "viewer"}))
            .send()
            .await
            .unwrap();
        let viewer_token = expect_json(added, StatusCode::CREATED).await["token"]
            .as_str()
            .unwrap()
            .to_owned();
        let viewer = browser(375).await;
        sign_in(&viewer, &app, &viewer_token).await;
        // Readable at 375 px: the page itself does not scroll sideways.
        let widths: Value = viewer
            .execute("return [window.innerWidth, document.documentElement.scrollWidth]", vec![])
            .await
            .unwrap();
        assert_eq!(widths[0], 375, "the emulated screen: {widths}");
        assert!(widths[1].as_u64().unwrap() <= 375, "the overview is {} px wide", widths[1]);
        screenshot(&viewer, "overview-375px").await;
        viewer.goto(&app.url("/console/tenants")).await.unwrap();
        let buttons = viewer.find_all(Locator::Css("main button")).await.unwrap();
        assert!(buttons.is_empty(), "a viewer's tenants page has no change buttons");
        viewer.close().await.unwrap();

        // Forged changes: the viewer's session with its own CSRF token, and
        // the operator's without one.
        let (viewer_cookie, viewer_csrf) = session_of(&app, &viewer_token).await;
        let pause = [("csrf", viewer_csrf.as_str()), ("status", "paused")];
        assert_eq!(post_form(&app, &viewer_cookie, "/console/tenants/acme", &pause).await, StatusCode::FORBIDDEN);
        let (root_cookie, root_csrf) = session_of(&app, ADMIN_TOKEN).await;
        let forged = [("csrf", "0000"), ("status", "paused")];
        assert_eq!(post_form(&app, &root_cookie, "/console/tenants/acme", &forged).await, StatusCode::FORBIDDEN);
        let tenant = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!(tenant["status"], "active", "no forged change was made");
        // With the session's token, the operator's change is made.
        let pause = [("csrf", root_csrf.as_str()), ("status", "paused")];
        assert_eq!(post_form(&app, &root_cookie, "/console/tenants/acme", &pause).await, StatusCode::SEE_OTHER);
        let tenant = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!(tenant["status"], "paused");
        // A wrong token does not sign in.
        let answer = reqwest::Client::new()
            .post(app.url("/console/login"))
            .form(&[("token", "fla_not-a-token")])
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::UNAUTHORIZED);
    }
}

/// The body of a console answer.
async fn form_answer(
    app: &TestApp,
    cookie: &str,
    path: &str,
    form: &[(&str, &str)],
) -> (StatusCode, String) {
    let answer = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(app.url(path))
        .header("cookie", cookie)
        .form(form)
        .send()
        .await
        .unwrap();
    (answer.status(), answer.text().await.unwrap())
}

on_both_stores! {
    async fn an_operator_manages_a_tenants_keys_identities_and_suppressions_in_the_console() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "basic").await;
        let (cookie, csrf) = session_of(&app, ADMIN_TOKEN).await;
        let csrf = csrf.as_str();

        // Search by recipient, however the address is written.
        let to_ann = app.send_accepted(&key, &with(crate::support::email(), "to", json!("Ann@Example.com"))).await;
        let to_bob = app.send_accepted(&key, &with(sms(), "to", json!("+15550001111"))).await;
        let found = console_page(&app, &cookie, "/console/messages?tenant=acme&recipient=ann%40EXAMPLE.com").await;
        assert!(found.contains(&to_ann) && !found.contains(&to_bob) && found.contains("1 message."), "{found}");
        let found = console_page(&app, &cookie, "/console/messages?tenant=acme&recipient=%2B15550001111").await;
        assert!(found.contains(&to_bob) && !found.contains(&to_ann), "{found}");
        let timeline = console_page(&app, &cookie, &format!("/console/messages/{to_ann}")).await;
        assert!(timeline.contains("ann@example.com"), "the timeline names the recipient: {timeline}");
        let answer = reqwest::Client::new()
            .get(app.url("/console/messages?tenant=acme&recipient=nobody"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert!(answer.text().await.unwrap().contains("recipient"));
        let tenant = "/console/tenants/acme";

        // A change of plan and retention, checked as the API checks it.
        let (status, page) = form_answer(&app, &cookie, tenant, &[("csrf", csrf), ("retention_days", "900")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(page.contains("retention_days") && page.contains("<html"), "a page naming the field: {page}");
        let (status, page) = form_answer(&app, &cookie, tenant, &[("csrf", csrf), ("plan", "no-such-plan")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{page}");
        assert!(page.contains("plan"), "{page}");
        let change = [("csrf", csrf), ("plan", "pro"), ("retention_days", "30"), ("max_concurrent_consumers", "3")];
        assert_eq!(post_form(&app, &cookie, tenant, &change).await, StatusCode::SEE_OTHER);
        let detail = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!((detail["plan"].as_str(), detail["retention_days"].as_u64()), (Some("pro"), Some(30)), "{detail}");
        assert_eq!(detail["max_concurrent_consumers"], 3);

        // A test key, then revoked.
        let (status, page) = form_answer(&app, &cookie, &format!("{tenant}/keys"), &[("csrf", csrf), ("kind", "test")]).await;
        assert_eq!(status, StatusCode::CREATED);
        let key = page.split("id=\"issued-key\"").nth(1).and_then(|rest| rest.split("value=\"").nth(1))
            .and_then(|rest| rest.split('"').next()).expect("the key on the page").to_owned();
        assert!(key.starts_with("fl_test_"), "{key}");
        let key_id = key.trim_start_matches("fl_test_").split('_').next().unwrap().to_owned();
        let revoke = format!("{tenant}/keys/{key_id}/revoke");
        assert_eq!(post_form(&app, &cookie, &revoke, &[("csrf", csrf)]).await, StatusCode::SEE_OTHER);
        let detail = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(), StatusCode::OK).await;
        let revoked = detail["keys"].as_array().unwrap().iter().find(|k| k["id"] == key_id.as_str()).unwrap();
        assert!(revoked["revoked_at"].is_string(), "{detail}");
        let (status, _) = form_answer(&app, &cookie, &revoke, &[("csrf", csrf)]).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "a revoked key cannot be revoked again");
        let (status, page) = form_answer(&app, &cookie, &format!("{tenant}/keys"), &[("csrf", csrf), ("kind", "gold")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(page.contains("kind"), "{page}");

        // A sender identity: refused without its from, added, removed.
        let senders = format!("{tenant}/senders");
        let (status, page) = form_answer(&app, &cookie, &senders, &[("csrf", csrf), ("channel", "email")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{page}");
        assert!(page.contains("from"), "{page}");
        let add = [("csrf", csrf), ("channel", "email"), ("from", "news@acme.example"), ("display_name", "Acme"), ("default", "on")];
        assert_eq!(post_form(&app, &cookie, &senders, &add).await, StatusCode::SEE_OTHER);
        let listed = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme/senders").send().await.unwrap(), StatusCode::OK).await;
        let sender = &listed["senders"][0];
        assert_eq!((sender["from"].as_str(), sender["default"].as_bool()), (Some("news@acme.example"), Some(true)), "{listed}");
        let remove = format!("{senders}/{}/remove", sender["id"].as_str().unwrap());
        assert_eq!(post_form(&app, &cookie, &remove, &[("csrf", csrf)]).await, StatusCode::SEE_OTHER);
        let listed = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme/senders").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!(listed["senders"], json!([]));

        // A suppression: a bad address refused, a good one added and shown,
        // then removed.
        let suppress = format!("{tenant}/suppressions");
        let (status, page) = form_answer(&app, &cookie, &suppress, &[("csrf", csrf), ("address", "not an address")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(page.contains("address"), "{page}");
        let add = [("csrf", csrf), ("address", "Someone@Example.com"), ("detail", "asked by phone")];
        assert_eq!(post_form(&app, &cookie, &suppress, &add).await, StatusCode::SEE_OTHER);
        let page = reqwest::Client::new().get(app.url(tenant)).header("cookie", &cookie).send().await.unwrap().text().await.unwrap();
        assert!(page.contains("someone@example.com") && page.contains("asked by phone"), "{page}");
        let unsuppress = format!("{suppress}/remove");
        let remove = [("csrf", csrf), ("address", "someone@example.com")];
        assert_eq!(post_form(&app, &cookie, &unsuppress, &remove).await, StatusCode::SEE_OTHER);
        let answer = app.admin(Method::GET, "/v1/admin/tenants/acme/suppressions/someone@example.com").send().await.unwrap();
        assert_eq!(answer.status(), StatusCode::NOT_FOUND);

        // A redrive of a selection needs one; a lane must be one.
        let (status, page) = form_answer(&app, &cookie, "/console/dlq/redrive", &[("csrf", csrf), ("lane", "fast"), ("what", "selected")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert!(page.contains("select at least one"), "{page}");
        let (status, _) = form_answer(&app, &cookie, "/console/dlq/redrive", &[("csrf", csrf), ("lane", "medium"), ("what", "all")]).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        let (status, _) = form_answer(&app, &cookie, "/console/dlq/redrive", &[("csrf", csrf), ("lane", "fast"), ("tenant", "nobody")]).await;
        assert_eq!(status, StatusCode::NOT_FOUND);

        // Every change is in the log, by action.
        let log = expect_json(app.admin(Method::GET, "/v1/admin/audit?action=POST%20/console/&limit=50").send().await.unwrap(), StatusCode::OK).await;
        let mut actions: Vec<&str> = log["entries"].as_array().unwrap().iter().map(|entry| entry["action"].as_str().unwrap()).collect();
        actions.sort_unstable();
        assert_eq!(actions, [
            "POST /console/tenants/{id}",
            "POST /console/tenants/{id}/keys",
            "POST /console/tenants/{id}/keys/{key_id}/revoke",
            "POST /console/tenants/{id}/senders",
            "POST /console/tenants/{id}/senders/{sender_id}/remove",
            "POST /console/tenants/{id}/suppressions",
            "POST /console/tenants/{id}/suppressions/remove",
        ], "only the changes that were made: {log}");
        let changed = log["entries"].as_array().unwrap().iter().find(|entry| entry["action"] == "POST /console/tenants/{id}").unwrap();
        assert_eq!((changed["before"]["plan"].as_str(), changed["after"]["plan"].as_str()), (Some("basic"), Some("pro")), "{changed}");

        // A viewer changes nothing here either.
        let added = app.admin(Method::POST, "/v1/admin/admins").json(&json!({"name": "desk", "role": "viewer"})).send().await.unwrap();
        let viewer = expect_json(added, StatusCode::CREATED).await["token"].as_str().unwrap().to_owned();
        let (viewer_cookie, viewer_csrf) = session_of(&app, &viewer).await;
        for (path, form) in [
            (tenant.to_owned(), vec![("plan", "basic")]),
            (format!("{tenant}/keys"), vec![("kind", "live")]),
            ("/console/tenants".to_owned(), vec![("id", "other"), ("name", "Other"), ("plan", "pro")]),
            ("/console/plans".to_owned(), vec![("name", "x"), ("lane", "fast"), ("rate_per_second", "1"), ("burst", "1"), ("daily_quota", "1"), ("max_in_flight", "1")]),
            (suppress.clone(), vec![("address", "a@example.com")]),
        ] {
            let mut form = form;
            form.push(("csrf", viewer_csrf.as_str()));
            assert_eq!(post_form(&app, &viewer_cookie, &path, &form).await, StatusCode::FORBIDDEN, "{path}");
        }
        let page = reqwest::Client::new().get(app.url(tenant)).header("cookie", &viewer_cookie).send().await.unwrap().text().await.unwrap();
        assert!(page.contains("API keys") && !page.contains("<button type=\"submit\">Issue key"), "a viewer's page has no forms: {page}");
        assert!(!page.contains("method=\"post\" action=\"/console/tenants/acme"), "{page}");
    }
}

/// A console page's HTML, read with `cookie`.
pub(crate) async fn console_page(app: &TestApp, cookie: &str, path: &str) -> String {
    let answer = reqwest::Client::new()
        .get(app.url(path))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK, "{path}");
    answer.text().await.unwrap()
}

on_both_stores! {
    async fn the_console_shows_the_last_hour_held_and_scheduled_sends_the_providers_and_replays_a_failing_webhook() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-hook").await;
        let endpoint = MockServer::start().await;
        let refusing = Mock::given(method("POST"))
            .respond_with(ResponseTemplate::new(500))
            .mount_as_scoped(&endpoint)
            .await;
        let settings = delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", crate::webhooks::FAST_WEBHOOKS);
        let app = TestApp::start(&settings).await;
        let key = app.tenant_with_key("acme", "pro").await;
        crate::webhooks::set_webhook(&app, &key, &endpoint.uri(), &["message.sent"]).await;
        let sent = app.send_accepted(&key, &sms()).await;
        wait_for(&app, &key, &sent, status_is("sent")).await;
        // One scheduled for tomorrow; then, paused, one held.
        let tomorrow = (chrono::Utc::now() + chrono::Duration::days(1)).to_rfc3339();
        app.send_accepted(&key, &with(sms(), "send_at", json!(tomorrow))).await;
        app.patch_tenant("acme", json!({"status": "paused"})).await;
        app.send_accepted(&key, &sms()).await;

        let (cookie, csrf) = session_of(&app, ADMIN_TOKEN).await;
        // The webhook call fails, and is retried: the endpoint is failing.
        let mut page = String::new();
        for _ in 0..100 {
            page = console_page(&app, &cookie, "/console/webhooks").await;
            if page.contains("HTTP 500") && page.contains(&sent) { break; }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(page.contains("failing") && page.contains(&endpoint.uri()) && page.contains("HTTP 500"), "{page}");
        assert!(page.contains("message.sent") && page.contains(&sent), "the failed call is listed: {page}");
        let timeline = console_page(&app, &cookie, &format!("/console/messages/{sent}")).await;
        assert!(timeline.contains("Webhook calls") && timeline.contains("HTTP 500"), "{timeline}");
        assert!(timeline.contains("SM-hook"), "sent, with the provider's id: {timeline}");
        assert!(timeline.contains("Accepted to sent") && timeline.contains("ms at the provider"), "the gate's wait: {timeline}");

        // The overview: 3 sends in the last hour, 1 scheduled, 1 held.
        let overview = console_page(&app, &cookie, "/console").await;
        assert!(overview.contains("3 sends in the last hour"), "{overview}");
        let row = overview.split("href=\"/console/tenants/acme\"").nth(1).unwrap().split("</tr>").next().unwrap();
        let cells: Vec<&str> = row.split("<td class=\"num\"").skip(1).map(|cell| cell.split('>').nth(1).unwrap().split('<').next().unwrap()).collect();
        // SQS and the lanes in PostgreSQL keep no held messages of their
        // own (consumers put them back): there, held is not known.
        let held = match crate::support::STORE.get() {
            crate::support::Store::Sqlite => "1",
            crate::support::Store::Postgres | crate::support::Store::PostgresLanes => "–",
        };
        assert_eq!(&cells[..3], ["1", held, "0"], "scheduled or retrying, held, at the gate: {row}");

        // The providers page names the SMS provider and its state.
        let providers = console_page(&app, &cookie, "/console/providers").await;
        assert!(providers.contains("<th scope=\"row\">sms</th>") && providers.contains("healthy"), "{providers}");

        // The endpoint recovers; the operator replays (a viewer may not).
        drop(refusing);
        Mock::given(method("POST")).respond_with(ResponseTemplate::new(204)).mount(&endpoint).await;
        let added = app.admin(Method::POST, "/v1/admin/admins").json(&json!({"name": "desk", "role": "viewer"})).send().await.unwrap();
        let viewer = expect_json(added, StatusCode::CREATED).await["token"].as_str().unwrap().to_owned();
        let (viewer_cookie, viewer_csrf) = session_of(&app, &viewer).await;
        let replay = "/console/webhooks/acme/replay";
        assert_eq!(post_form(&app, &viewer_cookie, replay, &[("csrf", viewer_csrf.as_str())]).await, StatusCode::FORBIDDEN);
        assert!(!console_page(&app, &viewer_cookie, "/console/webhooks").await.contains(replay), "no replay button for a viewer");
        assert_eq!(post_form(&app, &cookie, replay, &[("csrf", csrf.as_str())]).await, StatusCode::SEE_OTHER);
        for _ in 0..100 {
            page = console_page(&app, &cookie, "/console/webhooks").await;
            if page.contains("No webhook endpoint is failing") { break; }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert!(page.contains("No webhook endpoint is failing"), "{page}");
        let log = expect_json(app.admin(Method::GET, "/v1/admin/audit?action=POST%20/console/webhooks").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!(log["entries"][0]["target"], "/v1/admin/tenants/acme/webhook/redrive", "{log}");
        assert_eq!(log["entries"][0]["actor"]["name"], "root");
    }
}

on_both_stores! {
    /// Issue 68.5: a signed-out cookie opens nothing and changes nothing;
    /// every console answer forbids framing, script and caching; sign-in
    /// is throttled with a Retry-After.
    async fn sign_out_ends_the_session_on_the_server_and_sign_in_is_throttled() {
        let app = TestApp::start("").await;
        let (cookie, csrf) = session_of(&app, ADMIN_TOKEN).await;
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let overview = client
            .get(app.url("/console"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(overview.status(), StatusCode::OK);
        let headers = overview.headers();
        let csp = headers["content-security-policy"].to_str().unwrap();
        for part in ["frame-ancestors 'none'", "default-src 'none'", "style-src 'self'"] {
            assert!(csp.contains(part), "{csp}");
        }
        assert!(!csp.contains("script-src"), "no script is allowed: {csp}");
        assert_eq!(headers["x-frame-options"], "DENY");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert_eq!(headers["cache-control"], "no-store");
        assert!(headers.get("refresh").is_none(), "the page does not reload itself");
        let body = overview.text().await.unwrap();
        assert!(!body.contains("style=\""), "no inline style for the CSP to refuse");

        assert_eq!(
            post_form(&app, &cookie, "/console/logout", &[("csrf", &csrf)]).await,
            StatusCode::SEE_OTHER
        );
        let after = client
            .get(app.url("/console"))
            .header("cookie", &cookie)
            .send()
            .await
            .unwrap();
        assert_eq!(after.status(), StatusCode::SEE_OTHER);
        assert_eq!(after.headers()["location"], "/console/login");
        let forged = [("csrf", csrf.as_str()), ("id", "afterwards"), ("name", "A"), ("plan", "pro")];
        let created = post_form(&app, &cookie, "/console/tenants", &forged).await;
        assert_eq!(created, StatusCode::SEE_OTHER, "sent to sign in");
        let tenant = app.admin(Method::GET, "/v1/admin/tenants/afterwards").send().await.unwrap();
        assert_eq!(tenant.status(), StatusCode::NOT_FOUND, "the old cookie changed nothing");

        // One client may try 10 tokens at once (one try went on the
        // session above), then one every 6 s.
        let mut answers = Vec::new();
        for i in 0..10 {
            let answer = client
                .post(app.url("/console/login"))
                .form(&[("token", format!("fla_guess{i}"))])
                .send()
                .await
                .unwrap();
            answers.push((answer.status(), answer.headers().get("retry-after").cloned()));
        }
        assert!(answers[..9].iter().all(|(status, _)| *status == StatusCode::UNAUTHORIZED), "{answers:?}");
        let (status, retry) = &answers[9];
        assert_eq!(*status, StatusCode::TOO_MANY_REQUESTS, "{answers:?}");
        let secs: u64 = retry.as_ref().expect("Retry-After").to_str().unwrap().parse().unwrap();
        assert!((1..=6).contains(&secs), "{secs}");
    }
}
