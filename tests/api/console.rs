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
async fn session_of(app: &TestApp, token: &str) -> (String, String) {
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
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(app.url(path))
        .header("cookie", cookie)
        .form(form)
        .send()
        .await
        .unwrap()
        .status()
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
        let key = app.tenant_with_key("acme", "pro").await;
        let id = app.send_accepted(&key, &with(sms(), "reference", json!("order-42"))).await;
        wait_for(&app, &key, &id, status_is("dead_lettered")).await;

        let operator = browser(1280).await;
        sign_in(&operator, &app, ADMIN_TOKEN).await;
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

        // The provider recovers; the operator redrives the dead letter.
        drop(refusal);
        mock_sms_ok(&sms_api, "SM-console").await;
        operator.goto(&app.url("/console/dlq")).await.unwrap();
        operator
            .find(Locator::Css("main form[action='/console/dlq/redrive'] button"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        arrive(&operator, "/console/dlq").await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        let log = expect_json(
            app.admin(Method::GET, "/v1/admin/audit?target=/console/").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let entries = log["entries"].as_array().unwrap();
        assert_eq!(entries.len(), 1, "{log}");
        assert_eq!(entries[0]["action"], "POST /console/dlq/redrive");
        assert_eq!(entries[0]["actor"]["name"], "root");
        assert_eq!(entries[0]["after"]["redriven"], 1);
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
        assert_eq!(post_form(&app, &viewer_cookie, "/console/tenants/acme/status", &pause).await, StatusCode::FORBIDDEN);
        let (root_cookie, root_csrf) = session_of(&app, ADMIN_TOKEN).await;
        let forged = [("csrf", "0000"), ("status", "paused")];
        assert_eq!(post_form(&app, &root_cookie, "/console/tenants/acme/status", &forged).await, StatusCode::FORBIDDEN);
        let tenant = expect_json(app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(), StatusCode::OK).await;
        assert_eq!(tenant["status"], "active", "no forged change was made");
        // With the session's token, the operator's change is made.
        let pause = [("csrf", root_csrf.as_str()), ("status", "paused")];
        assert_eq!(post_form(&app, &root_cookie, "/console/tenants/acme/status", &pause).await, StatusCode::SEE_OTHER);
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
