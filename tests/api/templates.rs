//! Templates end to end: a tenant keeps versioned templates with locale
//! variants, previews them, and sends by template; the message is
//! rendered at delivery from the version it was accepted with, its
//! personalisation escaped in HTML, and the store never holds the
//! rendered body.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::delivery::{delivery_settings, mock_sms_ok, status_is, wait_for};
use crate::senders::{mail_of, ses_calls, ses_ok};
use crate::support::{
    TestApp, expect_field_error, expect_json, expect_problem, on_both_stores, with,
};

/// A welcome email with a French variant, always `high`, on the slow lane.
fn welcome() -> Value {
    json!({
        "name": "welcome",
        "channel": "email",
        "priority": "high",
        "lane": "slow",
        "subject": "Welcome, ((name))",
        "text": "Hello ((name)), your code is ((code)).",
        "html": "<p>Hello <b>((name))</b>, your code is ((code)).</p>",
        "locales": {
            "fr": {
                "subject": "Bienvenue, ((name))",
                "text": "Bonjour ((name)), votre code est ((code)).",
                "html": "<p>Bonjour <b>((name))</b> : ((code))</p>"
            }
        }
    })
}

/// Creates a template with `key`; panics unless 201.
async fn create(app: &TestApp, key: &str, template: &Value) -> Value {
    let response = app
        .tenant(key, Method::POST, "/v1/templates")
        .json(template)
        .send()
        .await
        .unwrap();
    let location = response.headers().get("location").cloned();
    let created = expect_json(response, StatusCode::CREATED).await;
    let id = created["id"].as_str().unwrap();
    assert!(id.starts_with("tpl_"), "{created}");
    assert_eq!(
        location.unwrap().to_str().unwrap(),
        format!("/v1/templates/{id}")
    );
    created
}

async fn preview(app: &TestApp, key: &str, id: &str, body: Value) -> reqwest::Response {
    app.tenant(key, Method::POST, &format!("/v1/templates/{id}/preview"))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// A test key of `tenant`.
async fn test_key(app: &TestApp, tenant: &str) -> String {
    let issued = expect_json(
        app.admin(Method::POST, &format!("/v1/admin/tenants/{tenant}/keys"))
            .json(&json!({"kind": "test"}))
            .send()
            .await
            .unwrap(),
        StatusCode::CREATED,
    )
    .await;
    issued["key"].as_str().unwrap().to_owned()
}

on_both_stores! {
    /// A tenant creates, reads, changes (a new version each time), lists,
    /// previews and deletes its templates; a test key reads and previews
    /// but may not change them; bad templates are refused naming the
    /// field; admins do the same for any tenant.
    async fn templates_are_versioned_previewed_and_managed() {
        let app = TestApp::start("").await;
        let acme = app.tenant_with_key("acme", "pro").await;
        let acme_test = test_key(&app, "acme").await;
        let globex = app.tenant_with_key("globex", "pro").await;

        let created = create(&app, &acme, &welcome()).await;
        let id = created["id"].as_str().unwrap().to_owned();
        assert_eq!(created["version"], 1, "{created}");
        assert_eq!(created["placeholders"], json!(["code", "name"]), "{created}");
        assert_eq!(created["locales"]["fr"]["subject"], "Bienvenue, ((name))");

        // A test key may not change the templates both worlds send with.
        let refused = app
            .tenant(&acme_test, Method::POST, "/v1/templates")
            .json(&with(welcome(), "name", json!("other")))
            .send()
            .await
            .unwrap();
        expect_problem(refused, StatusCode::FORBIDDEN).await;
        // A name is the tenant's once.
        let taken = app
            .tenant(&acme, Method::POST, "/v1/templates")
            .json(&welcome())
            .send()
            .await
            .unwrap();
        expect_problem(taken, StatusCode::CONFLICT).await;

        // A change is a new version; the old one stays readable.
        let changed = expect_json(
            app.tenant(&acme, Method::PUT, &format!("/v1/templates/{id}"))
                .json(&with(welcome(), "subject", json!("Hi ((name))!")))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(changed["version"], 2, "{changed}");
        assert_eq!(changed["latest_version"], 2, "{changed}");
        let first = expect_json(
            app.tenant(&acme_test, Method::GET, &format!("/v1/templates/{id}?version=1"))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(first["subject"], "Welcome, ((name))", "{first}");
        assert_eq!(first["latest_version"], 2, "{first}");
        let none = app
            .tenant(&acme, Method::GET, &format!("/v1/templates/{id}?version=9"))
            .send()
            .await
            .unwrap();
        expect_problem(none, StatusCode::NOT_FOUND).await;
        // Another tenant does not see it.
        let theirs = app
            .tenant(&globex, Method::GET, &format!("/v1/templates/{id}"))
            .send()
            .await
            .unwrap();
        expect_problem(theirs, StatusCode::NOT_FOUND).await;

        // Preview: the locale's variant (fr-CA → fr), values escaped in HTML.
        let shown = expect_json(
            preview(
                &app,
                &acme_test,
                &id,
                json!({"locale": "fr-CA", "personalisation": {"name": "<Ann>", "code": 42}}),
            )
            .await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(shown["locale"], "fr", "{shown}");
        assert_eq!(shown["version"], 2, "{shown}");
        assert_eq!(shown["subject"], "Bienvenue, <Ann>");
        assert_eq!(shown["text"], "Bonjour <Ann>, votre code est 42.");
        assert_eq!(shown["html"], "<p>Bonjour <b>&lt;Ann&gt;</b> : 42</p>");
        let missing = preview(&app, &acme, &id, json!({"personalisation": {"name": "A"}})).await;
        expect_field_error(missing, "personalisation.code").await;
        let unknown = preview(
            &app,
            &acme,
            &id,
            json!({"personalisation": {"name": "A", "code": 1, "colour": "red"}}),
        )
        .await;
        expect_field_error(unknown, "personalisation.colour").await;

        // An SMS template previews with its fragments and encoding.
        let sms = create(
            &app,
            &acme,
            &json!({"name": "code", "channel": "sms", "text": "Ton code : ((code)) ✓"}),
        )
        .await;
        let shown = expect_json(
            preview(
                &app,
                &acme,
                sms["id"].as_str().unwrap(),
                json!({"personalisation": {"code": "123456"}}),
            )
            .await,
            StatusCode::OK,
        )
        .await;
        assert_eq!(shown["text"], "Ton code : 123456 ✓");
        assert_eq!(shown["encoding"], "ucs2", "{shown}");
        assert_eq!(shown["fragments"], 1, "{shown}");

        // Bad templates are refused naming the field.
        let mut bad = welcome();
        bad["name"] = json!("bad");
        bad["locales"]["fr"]["text"] = json!("Bonjour ((name");
        let refused = app
            .tenant(&acme, Method::POST, "/v1/templates")
            .json(&bad)
            .send()
            .await
            .unwrap();
        expect_field_error(refused, "locales.fr.text").await;
        let refused = app
            .tenant(&acme, Method::POST, "/v1/templates")
            .json(&json!({"name": "x", "channel": "sms", "text": "t", "subject": "s"}))
            .send()
            .await
            .unwrap();
        expect_field_error(refused, "subject").await;
        let refused = app
            .tenant(&acme, Method::PUT, &format!("/v1/templates/{id}"))
            .json(&json!({"name": "welcome", "channel": "sms", "text": "t"}))
            .send()
            .await
            .unwrap();
        expect_field_error(refused, "channel").await;

        // Admins list, create and delete any tenant's.
        let listed = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/templates")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        let names: Vec<&str> = listed["templates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{listed}");
        assert!(names.contains(&"welcome") && names.contains(&"code"), "{listed}");
        let made = expect_json(
            app.admin(Method::POST, "/v1/admin/tenants/globex/templates")
                .json(&welcome())
                .send()
                .await
                .unwrap(),
            StatusCode::CREATED,
        )
        .await;
        let gone = app
            .admin(Method::GET, "/v1/admin/tenants/nobody/templates")
            .send()
            .await
            .unwrap();
        expect_problem(gone, StatusCode::NOT_FOUND).await;
        let deleted = app
            .admin(
                Method::DELETE,
                &format!("/v1/admin/tenants/globex/templates/{}", made["id"].as_str().unwrap()),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(deleted.status(), StatusCode::NO_CONTENT);

        // A deleted template takes no sends.
        let deleted = app
            .tenant(&acme, Method::DELETE, &format!("/v1/templates/{id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(deleted.status(), StatusCode::NO_CONTENT);
        let send = app
            .send(
                &acme,
                &json!({"channel": "email", "to": "a@example.com", "template_id": id,
                        "personalisation": {"name": "A", "code": 1}}),
            )
            .await;
        expect_field_error(send, "template_id").await;
    }
}

on_both_stores! {
    /// A send by template goes to SES rendered from the version it named,
    /// in its locale's variant, with the personalisation escaped in the
    /// HTML; it takes the template's priority and lane; its status names
    /// the template and version. A send with a missing placeholder, an
    /// unknown one, content beside the template or the wrong channel is
    /// refused naming the field, and a batch checks each item.
    async fn a_send_by_template_is_rendered_at_delivery() {
        let ses = ses_ok().await;
        let sms_server = wiremock::MockServer::start().await;
        mock_sms_ok(&sms_server, "SM1").await;
        let app = TestApp::start(&delivery_settings(&sms_server.uri(), &ses.uri(), "")).await;
        let acme = app.tenant_with_key("acme", "pro").await;
        let created = create(&app, &acme, &welcome()).await;
        let id = created["id"].as_str().unwrap().to_owned();
        // Version 2 changes the text; a send naming version 1 keeps it.
        expect_json(
            app.tenant(&acme, Method::PUT, &format!("/v1/templates/{id}"))
                .json(&with(welcome(), "text", json!("Changed for ((name)) ((code))")))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;

        let hostile = "<script>alert('x')</script>";
        let send = json!({"channel": "email", "to": "a@example.com", "template_id": id,
                          "template_version": 1, "locale": "fr-CA", "priority": "low",
                          "personalisation": {"name": hostile, "code": "9 & 10"}});
        let answer = expect_json(app.send(&acme, &send).await, StatusCode::ACCEPTED).await;
        assert_eq!(answer["priority"], "high", "the template's priority: {answer}");
        assert_eq!(answer["lane"], "slow", "the template's lane: {answer}");
        let message = answer["id"].as_str().unwrap().to_owned();
        let view = wait_for(&app, &acme, &message, status_is("sent")).await;
        assert_eq!(view["template_id"], id.as_str(), "{view}");
        assert_eq!(view["template_version"], 1, "{view}");

        let newest = json!({"channel": "email", "to": "b@example.com", "template_id": id,
                            "personalisation": {"name": "Bo", "code": 7}});
        let second = app.send_accepted(&acme, &newest).await;
        wait_for(&app, &acme, &second, status_is("sent")).await;

        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 2, "{calls:?}");
        let mail = mail_of(&calls[0]);
        assert_eq!(mail.subject, Some(format!("Bienvenue, {hostile}")));
        assert_eq!(mail.content_type, "multipart/alternative");
        assert_eq!(
            mail.text,
            Some(format!("Bonjour {hostile}, votre code est 9 & 10."))
        );
        assert_eq!(
            mail.html.as_deref(),
            Some("<p>Bonjour <b>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;</b> : 9 &amp; 10</p>")
        );
        let mail = mail_of(&calls[1]);
        assert_eq!(mail.subject.as_deref(), Some("Welcome, Bo"));
        assert_eq!(mail.text.as_deref(), Some("Changed for Bo 7"));

        // Refusals name the field.
        let sms_template = create(
            &app,
            &acme,
            &json!({"name": "code", "channel": "sms", "text": "Code ((code))"}),
        )
        .await;
        let sms_id = sms_template["id"].as_str().unwrap();
        let missing = json!({"channel": "sms", "to": "+15551234567", "template_id": sms_id});
        expect_field_error(app.send(&acme, &missing).await, "personalisation.code").await;
        let unknown = with(missing.clone(), "personalisation", json!({"code": 1, "x": 2}));
        expect_field_error(app.send(&acme, &unknown).await, "personalisation.x").await;
        let content = with(
            with(missing.clone(), "personalisation", json!({"code": 1})),
            "text",
            json!("hi"),
        );
        expect_field_error(app.send(&acme, &content).await, "text").await;
        let wrong = json!({"channel": "sms", "to": "+15551234567", "template_id": id,
                           "personalisation": {"name": "A", "code": 1}});
        expect_field_error(app.send(&acme, &wrong).await, "template_id").await;
        let other = json!({"channel": "sms", "to": "+15551234567", "template_id": "tpl_nope"});
        expect_field_error(app.send(&acme, &other).await, "template_id").await;

        // An SMS by template answers with its rendered text's fragments.
        let ok = with(missing.clone(), "personalisation", json!({"code": "x".repeat(200)}));
        let answer = expect_json(app.send(&acme, &ok).await, StatusCode::ACCEPTED).await;
        assert_eq!(answer["fragments"], 2, "{answer}");
        let sms_message = answer["id"].as_str().unwrap().to_owned();
        wait_for(&app, &acme, &sms_message, status_is("sent")).await;
        let texts: Vec<String> = sms_server
            .received_requests()
            .await
            .unwrap()
            .iter()
            .map(|request| {
                form_urlencoded::parse(&request.body)
                    .find(|(name, _)| name == "Body")
                    .map(|(_, body)| body.into_owned())
                    .unwrap_or_default()
            })
            .collect();
        assert_eq!(texts, vec![format!("Code {}", "x".repeat(200))]);

        // A batch by template checks each item.
        let batch = json!({"messages": [
            with(missing.clone(), "personalisation", json!({"code": 5})),
            missing,
        ]});
        let answer = expect_json(
            app.tenant(&acme, Method::POST, "/v1/messages/batch")
                .json(&batch)
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        let items = answer["results"].as_array().expect("results");
        assert_eq!(items[0]["status"], 202, "{answer}");
        assert_eq!(items[0]["message"]["status"], "queued", "{answer}");
        assert!(
            items[1].to_string().contains("personalisation.code"),
            "{answer}"
        );
    }
}

/// The store keeps a template send's personalisation, never its rendered
/// body: a scheduled send waits with its values, and no byte of the
/// SQLite file (or its log) holds the sentence they render to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_holds_personalisation_not_the_rendered_body() {
    let app = TestApp::start("").await;
    let acme = app.tenant_with_key("acme", "pro").await;
    let created = create(&app, &acme, &welcome()).await;
    let at = chrono::Utc::now() + chrono::Duration::hours(1);
    let send = json!({"channel": "email", "to": "a@example.com",
                      "template_id": created["id"], "send_at": at.to_rfc3339(),
                      "personalisation": {"name": "Zebedee-7731", "code": "QX-5521"}});
    app.send_accepted(&acme, &send).await;
    let dir = app.stop().await;
    let mut bytes = Vec::new();
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        bytes.extend(std::fs::read(entry.unwrap().path()).unwrap());
    }
    let holds = |needle: &str| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(holds("Zebedee-7731"), "the personalisation is kept");
    assert!(holds("QX-5521"), "the personalisation is kept");
    assert!(
        !holds("Hello Zebedee-7731, your code is QX-5521."),
        "the rendered text is not stored"
    );
    assert!(
        !holds("Welcome, Zebedee-7731"),
        "the rendered subject is not stored"
    );
}

/// The peak resident set of process `pid` (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc status")
}

/// Issue 68.3: a template that uses one placeholder 2,000 times, given a
/// 10,000-character value of `"` (120 MB once escaped), is refused with
/// 422 by preview and by send before any of it is built. Measured on the
/// real binary, whose peak RSS is its own (tests in this process share
/// theirs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rendering_too_big_is_refused_before_it_is_built() {
    let dir = tempfile::tempdir().unwrap();
    let port = crate::crash::free_port();
    let server = crate::crash::start(&dir.path().join("fairlane.db"), port);
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    crate::crash::wait_ready(&client, &base).await;
    let key = crate::crash::unlimited_tenant(&client, &base, crate::crash::ADMIN).await;
    let template = json!({"name": "wide", "channel": "email", "subject": "Hi",
                          "text": "Hello", "html": "((a))".repeat(2_000)});
    let created = client
        .post(format!("{base}/v1/templates"))
        .bearer_auth(&key)
        .json(&template)
        .send()
        .await
        .unwrap();
    let created = expect_json(created, StatusCode::CREATED).await;
    let id = created["id"].as_str().unwrap().to_owned();
    let preview = |value: String| {
        client
            .post(format!("{base}/v1/templates/{id}/preview"))
            .bearer_auth(&key)
            .json(&json!({"personalisation": {"a": value}}))
            .send()
    };
    // Warm: a small rendering, so the figure below is the big one's alone.
    expect_json(preview("x".into()).await.unwrap(), StatusCode::OK).await;
    let before = peak_rss_kib(server.0.id());

    let huge = "\"".repeat(10_000);
    let refused = expect_field_error(preview(huge.clone()).await.unwrap(), "personalisation").await;
    let why = refused["errors"]["personalisation"].as_str().unwrap();
    assert!(why.contains("120000000 bytes"), "{refused}");
    let send = json!({"channel": "email", "to": "a@example.com", "template_id": id,
                      "personalisation": {"a": huge}});
    let sent = client
        .post(format!("{base}/v1/messages"))
        .bearer_auth(&key)
        .json(&send)
        .send()
        .await
        .unwrap();
    expect_field_error(sent, "personalisation").await;

    let grown = peak_rss_kib(server.0.id()).saturating_sub(before);
    eprintln!("peak RSS growth over the two refusals: {grown} KiB");
    assert!(
        grown < 16 * 1024,
        "the refusals grew the peak RSS by {grown} KiB"
    );
}
