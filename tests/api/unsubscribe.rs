//! One-click unsubscribe end to end: the headers an email carries to SES,
//! a forged link that changes nothing, a `GET` that changes nothing, the
//! `POST` that suppresses the address and fires a signed
//! `message.unsubscribed` webhook, custom headers from the allow-list, and
//! the tenant's default with its `mailto:`.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::delivery::{delivery_settings, status_is, wait_for};
use crate::receipts::PUBLIC_URL;
use crate::senders::{ses_calls, ses_ok};
use crate::support::{
    TestApp, email, expect_field_error, expect_json, expect_problem, on_both_stores, sms, with,
};
use crate::webhooks::{
    FAST_WEBHOOKS, body_of, calls_on, endpoint_ok, set_webhook, verify_with_standard_webhooks,
};

/// The value of header `name` of an SES SendEmail call's message.
fn header(call: &Value, name: &str) -> Option<String> {
    crate::senders::mail_of(call)
        .header(name)
        .map(str::to_owned)
}

/// The path of the https link in a `List-Unsubscribe` value.
fn link_path(value: &str) -> String {
    let start = value.find(PUBLIC_URL).expect("an https link") + PUBLIC_URL.len();
    let end = value[start..].find('>').unwrap() + start;
    value[start..end].to_owned()
}

async fn suppression(app: &TestApp, key: &str, address: &str) -> reqwest::Response {
    app.tenant(key, Method::GET, &format!("/v1/suppressions/{address}"))
        .send()
        .await
        .unwrap()
}

on_both_stores! {
    async fn a_one_click_post_suppresses_the_address_and_a_forged_link_changes_nothing() {
        let ses = ses_ok().await;
        let settings = delivery_settings("http://127.0.0.1:9", &ses.uri(), FAST_WEBHOOKS);
        let app = TestApp::start_custom(&settings, |settings| {
            settings.server.public_url = Some(PUBLIC_URL.into());
        })
        .await;
        let key = app.tenant_with_key("acme", "pro").await;
        let endpoint = endpoint_ok().await;
        let hook = set_webhook(&app, &key, &endpoint.uri(), &["message.unsubscribed"]).await;
        let secret = hook["secret"].as_str().unwrap().to_owned();

        let body = with(
            with(email(), "to", json!("Ada@Example.com")),
            "unsubscribe",
            json!(true),
        );
        let body = with(body, "headers", json!({"X-Campaign": "spring", "List-Id": "<news.acme.example>"}));
        let id = app.send_accepted(&key, &body).await;
        wait_for(&app, &key, &id, status_is("sent")).await;
        let plain = app.send_accepted(&key, &email()).await;
        wait_for(&app, &key, &plain, status_is("sent")).await;

        let calls = ses_calls(&ses).await;
        let call = &calls[0];
        let list = header(call, "List-Unsubscribe").expect("List-Unsubscribe");
        assert!(list.starts_with(&format!("<{PUBLIC_URL}/v1/unsubscribe/")), "{list}");
        assert!(!list.contains("mailto:"), "no mailto unless the tenant sets one: {list}");
        assert_eq!(
            header(call, "List-Unsubscribe-Post").as_deref(),
            Some("List-Unsubscribe=One-Click")
        );
        assert_eq!(header(call, "X-Campaign").as_deref(), Some("spring"));
        assert_eq!(
            header(call, "List-Id").as_deref(),
            Some("<news.acme.example>")
        );
        assert_eq!(header(&calls[1], "List-Unsubscribe"), None, "not asked for");
        let path = link_path(&list);

        // A forged link (one character of the token changed) and a GET of
        // the real one change nothing.
        let mut forged = path.clone().into_bytes();
        let at = forged.len() - 3;
        forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap();
        for bad in [forged.as_str(), "/v1/unsubscribe/not-a-token"] {
            let answer = app.client.post(app.url(bad)).send().await.unwrap();
            expect_problem(answer, StatusCode::NOT_FOUND).await;
        }
        let shown = app.client.get(app.url(&path)).send().await.unwrap();
        assert_eq!(shown.status(), StatusCode::OK);
        assert!(shown.text().await.unwrap().contains("<form method=\"post\""));
        expect_problem(
            suppression(&app, &key, "ada@example.com").await,
            StatusCode::NOT_FOUND,
        )
        .await;

        // The token is sealed: decoded, it holds no address and no tenant.
        let token = path.rsplit('/').next().unwrap();
        let sealed = token.strip_prefix("2.").expect("a sealed token");
        let raw = base64::Engine::decode(&base64::engine::general_purpose::URL_SAFE_NO_PAD, sealed)
            .expect("base64url");
        let raw = String::from_utf8_lossy(&raw);
        assert!(!raw.to_lowercase().contains("ada@example.com") && !raw.contains("acme"), "{raw}");

        // A POST that is not RFC 8058's one click changes nothing: no body,
        // another value, the field in JSON.
        let no_body = app.client.post(app.url(&path)).send().await.unwrap();
        expect_problem(no_body, StatusCode::BAD_REQUEST).await;
        let no = app
            .client
            .post(app.url(&path))
            .form(&[("List-Unsubscribe", "No")])
            .send()
            .await
            .unwrap();
        expect_problem(no, StatusCode::BAD_REQUEST).await;
        let json_body = app
            .client
            .post(app.url(&path))
            .json(&json!({"List-Unsubscribe": "One-Click"}))
            .send()
            .await
            .unwrap();
        expect_problem(json_body, StatusCode::BAD_REQUEST).await;
        expect_problem(
            suppression(&app, &key, "ada@example.com").await,
            StatusCode::NOT_FOUND,
        )
        .await;

        // The one click, as a mail provider sends it.
        let clicked = app
            .client
            .post(app.url(&path))
            .form(&[("List-Unsubscribe", "One-Click")])
            .send()
            .await
            .unwrap();
        assert_eq!(clicked.status(), StatusCode::OK);
        let listed = expect_json(suppression(&app, &key, "ada@example.com").await, StatusCode::OK).await;
        assert_eq!(listed["reason"], "unsubscribe", "{listed}");
        assert_eq!(listed["message_id"], id.as_str(), "{listed}");

        let calls = calls_on(&endpoint, 1).await;
        assert_eq!(calls.len(), 1, "one message.unsubscribed call");
        verify_with_standard_webhooks(&secret, &calls);
        let event = body_of(&calls[0]);
        assert_eq!(event["type"], "message.unsubscribed", "{event}");
        assert_eq!(event["data"]["id"], id.as_str(), "{event}");

        // Clicking again changes nothing more: one event, no second call.
        // This time as multipart/form-data, which mail clients also send.
        let boundary = "fairlane-test-boundary";
        let again = app
            .client
            .post(app.url(&path))
            .header(
                "content-type",
                format!("multipart/form-data; boundary={boundary}"),
            )
            .body(format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"List-Unsubscribe\"\r\n\r\n\
                 One-Click\r\n--{boundary}--\r\n"
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), StatusCode::OK);
        let events = expect_json(
            app.tenant(&key, Method::GET, &format!("/v1/messages/{id}/events"))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        let unsubscribed = events["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["event"] == "unsubscribed")
            .count();
        assert_eq!(unsubscribed, 1, "{events}");

        // The address is suppressed for this tenant's next email.
        let next = app
            .send_accepted(&key, &with(email(), "to", json!("ada@example.com")))
            .await;
        wait_for(&app, &key, &next, status_is("suppressed")).await;
        assert_eq!(ses_calls(&ses).await.len(), 2, "no SES call for it");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_outside_the_allow_list_and_unsubscribe_on_sms_are_refused_by_name() {
    let app = TestApp::start_custom("", |settings| {
        settings.server.public_url = Some(PUBLIC_URL.into());
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    for headers in [
        json!({"From": "ceo@acme.example"}),
        json!({"DKIM-Signature": "v=1"}),
        json!({"X-SES-CONFIGURATION-SET": "other"}),
        json!({"List-Unsubscribe": "<https://elsewhere.example>"}),
        json!({"X-Line": "one\r\nBcc: eve@example.com"}),
        json!({"X-Tab": "a\tb"}),
        // SES takes 1-870 printable ASCII characters and nothing else.
        json!({"X-Note": "café"}),
        json!({"X-Long": "v".repeat(871)}),
        json!({"X-Empty": ""}),
        json!({"X-Number": 7}),
        json!(["X-Campaign"]),
    ] {
        expect_field_error(
            app.send(&key, &with(email(), "headers", headers)).await,
            "headers",
        )
        .await;
    }
    // The longest value SES takes, of every printable character.
    let printable: String = (b' '..=b'~').map(char::from).cycle().take(870).collect();
    app.send_accepted(
        &key,
        &with(email(), "headers", json!({"X-Note": printable})),
    )
    .await;
    expect_field_error(
        app.send(&key, &with(email(), "unsubscribe", json!("yes")))
            .await,
        "unsubscribe",
    )
    .await;
    for field in ["unsubscribe", "headers"] {
        expect_field_error(
            app.send(&key, &with(sms(), field, json!(true))).await,
            field,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_public_url_unsubscribe_is_refused_naming_the_field() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    expect_field_error(
        app.send(&key, &with(email(), "unsubscribe", json!(true)))
            .await,
        "unsubscribe",
    )
    .await;
    expect_field_error(
        app.admin(Method::PATCH, "/v1/admin/tenants/acme")
            .json(&json!({"unsubscribe_default": true}))
            .send()
            .await
            .unwrap(),
        "unsubscribe_default",
    )
    .await;
    // And the links' route knows no token.
    let answer = app
        .client
        .post(app.url("/v1/unsubscribe/abc.def"))
        .send()
        .await
        .unwrap();
    expect_problem(answer, StatusCode::NOT_FOUND).await;
}

on_both_stores! {
    /// A tenant whose default asks for unsubscribe gets the headers without
    /// asking, with its mailto:, unless a send says `unsubscribe: false`.
    async fn the_tenants_default_adds_the_headers_with_its_mailto() {
        let ses = ses_ok().await;
        let settings = delivery_settings("http://127.0.0.1:9", &ses.uri(), "");
        let app = TestApp::start_custom(&settings, |settings| {
            settings.server.public_url = Some(PUBLIC_URL.into());
        })
        .await;
        let key = app.tenant_with_key("acme", "pro").await;
        expect_field_error(
            app.admin(Method::PATCH, "/v1/admin/tenants/acme")
                .json(&json!({"unsubscribe_mailto": "not an address"}))
                .send()
                .await
                .unwrap(),
            "unsubscribe_mailto",
        )
        .await;
        let tenant = app
            .patch_tenant(
                "acme",
                json!({"unsubscribe_default": true, "unsubscribe_mailto": "leave@acme.example"}),
            )
            .await;
        assert_eq!(tenant["unsubscribe_default"], true, "{tenant}");
        assert_eq!(tenant["unsubscribe_mailto"], "leave@acme.example", "{tenant}");

        let asked = app.send_accepted(&key, &email()).await;
        wait_for(&app, &key, &asked, status_is("sent")).await;
        let declined = app
            .send_accepted(&key, &with(email(), "unsubscribe", json!(false)))
            .await;
        wait_for(&app, &key, &declined, status_is("sent")).await;
        let calls = ses_calls(&ses).await;
        let list = header(&calls[0], "List-Unsubscribe").expect("by default");
        assert!(
            list.ends_with(", <mailto:leave@acme.example?subject=unsubscribe>"),
            "{list}"
        );
        assert_eq!(header(&calls[1], "List-Unsubscribe"), None);

        // "" removes the mailto.
        let tenant = app.patch_tenant("acme", json!({"unsubscribe_mailto": ""})).await;
        assert!(tenant.get("unsubscribe_mailto").is_none(), "{tenant}");
    }
}

/// A tenant deleted and created again under the same id does not honour
/// the old tenant's links: the old recipient is not added to the new
/// tenant's list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_created_again_does_not_honour_the_old_tenants_links() {
    let ses = ses_ok().await;
    let settings = delivery_settings("http://127.0.0.1:9", &ses.uri(), "");
    let app = TestApp::start_custom(&settings, |settings| {
        settings.server.public_url = Some(PUBLIC_URL.into());
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    let body = with(
        with(email(), "to", json!("ada@example.com")),
        "unsubscribe",
        json!(true),
    );
    let id = app.send_accepted(&key, &body).await;
    wait_for(&app, &key, &id, status_is("sent")).await;
    let calls = ses_calls(&ses).await;
    let path = link_path(&header(&calls[0], "List-Unsubscribe").expect("List-Unsubscribe"));
    let gone = app
        .admin(Method::DELETE, "/v1/admin/tenants/acme")
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), StatusCode::NO_CONTENT, "delete the tenant");
    let key = app.tenant_with_key("acme", "pro").await;
    let clicked = app
        .client
        .post(app.url(&path))
        .form(&[("List-Unsubscribe", "One-Click")])
        .send()
        .await
        .unwrap();
    expect_problem(clicked, StatusCode::NOT_FOUND).await;
    let shown = app.client.get(app.url(&path)).send().await.unwrap();
    expect_problem(shown, StatusCode::NOT_FOUND).await;
    expect_problem(
        suppression(&app, &key, "ada@example.com").await,
        StatusCode::NOT_FOUND,
    )
    .await;
}
