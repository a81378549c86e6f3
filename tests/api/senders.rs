//! Sender identities end to end: an admin gives a tenant its own senders,
//! sends name one (or get the tenant's default), a send naming another
//! tenant's is refused, and the SES and SMS calls carry the identity.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::delivery::{delivery_settings, mock_sms_ok, status_is, wait_for};
use crate::support::{
    TestApp, email, expect_field_error, expect_json, expect_problem, on_both_stores, sms, with,
};

/// Adds an identity to `tenant`; panics unless the answer is 201.
pub(crate) async fn add_sender(app: &TestApp, tenant: &str, identity: Value) -> Value {
    let response = app
        .admin(Method::POST, &format!("/v1/admin/tenants/{tenant}/senders"))
        .json(&identity)
        .send()
        .await
        .unwrap();
    let location = response.headers().get("location").cloned();
    let created = expect_json(response, StatusCode::CREATED).await;
    assert_eq!(
        location.unwrap().to_str().unwrap(),
        format!(
            "/v1/admin/tenants/{tenant}/senders/{}",
            created["id"].as_str().unwrap()
        )
    );
    created
}

/// The admin's listing of `tenant`'s identities; panics unless 200.
async fn listed_senders(app: &TestApp, tenant: &str) -> Value {
    expect_json(
        app.admin(Method::GET, &format!("/v1/admin/tenants/{tenant}/senders"))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await
}

fn ids(list: &Value) -> Vec<&str> {
    list["senders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect()
}

on_both_stores! {
    /// Admins add, list, re-default and remove identities; a send may name
    /// only one of its own tenant's, of its own channel.
    async fn identities_are_managed_by_admins_and_checked_on_every_send() {
        let app = TestApp::start("").await;
        let acme = app.tenant_with_key("acme", "pro").await;
        let globex = app.tenant_with_key("globex", "pro").await;
        let theirs = add_sender(
            &app,
            "globex",
            json!({"channel": "email", "from": "news@globex.example"}),
        )
        .await;
        let texts = add_sender(
            &app,
            "acme",
            json!({"channel": "sms", "from": "ACME", "default": true}),
        )
        .await;
        assert_eq!(texts["default"], true, "{texts}");
        assert!(texts["id"].as_str().unwrap().starts_with("snd_"), "{texts}");
        let mails = add_sender(
            &app,
            "acme",
            json!({"channel": "email", "from": "news@acme.example", "display_name": "Acme News",
                   "reply_to": ["help@acme.example"], "configuration_set": "acme-events"}),
        )
        .await;
        assert_eq!(mails["reply_to"], json!(["help@acme.example"]), "{mails}");

        // Bad identities are refused naming the field; nothing is added.
        for (bad, field) in [
            (json!({"channel": "email", "from": "Acme <news@acme.example>"}), "from"),
            (json!({"channel": "email"}), "from"),
            (json!({"channel": "sms", "from": "+15550001111", "display_name": "x"}), "display_name"),
            (json!({"channel": "sms", "messaging_service_sid": "MG1"}), "messaging_service_sid"),
        ] {
            expect_field_error(
                app.admin(Method::POST, "/v1/admin/tenants/acme/senders")
                    .json(&bad)
                    .send()
                    .await
                    .unwrap(),
                field,
            )
            .await;
        }
        expect_problem(
            app.admin(Method::POST, "/v1/admin/tenants/nobody/senders")
                .json(&json!({"channel": "sms", "from": "ACME"}))
                .send()
                .await
                .unwrap(),
            StatusCode::NOT_FOUND,
        )
        .await;
        let listed = listed_senders(&app, "acme").await;
        assert_eq!(
            ids(&listed),
            [texts["id"].as_str().unwrap(), mails["id"].as_str().unwrap()]
        );
        // A tenant sees its own identities only.
        let own = expect_json(
            app.tenant(&globex, Method::GET, "/v1/senders")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(ids(&own), [theirs["id"].as_str().unwrap()]);

        // Another tenant's identity, an unknown one, one of the other
        // channel: 422 naming sender_id.
        for sender in [&theirs["id"], &json!("snd_0000000000000000"), &texts["id"]] {
            let body = expect_field_error(
                app.send(&acme, &with(email(), "sender_id", sender.clone()))
                    .await,
                "sender_id",
            )
            .await;
            assert!(
                !body.to_string().contains("globex"),
                "the answer says nothing of the other tenant: {body}"
            );
        }
        expect_field_error(
            app.send(&acme, &with(sms(), "sender_id", json!(""))).await,
            "sender_id",
        )
        .await;
        // Its own, of the right channel: accepted.
        for (body, sender) in [(email(), &mails["id"]), (sms(), &texts["id"])] {
            let response = app.send(&acme, &with(body, "sender_id", sender.clone())).await;
            assert_eq!(response.status(), StatusCode::ACCEPTED);
        }

        // The email identity becomes the default; then it is removed, and
        // a send naming it is refused from then on.
        let path = format!("/v1/admin/tenants/acme/senders/{}", mails["id"].as_str().unwrap());
        let changed = expect_json(
            app.admin(Method::PATCH, &path)
                .json(&json!({"default": true}))
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(changed["default"], true, "{changed}");
        expect_field_error(
            app.admin(Method::PATCH, &path)
                .json(&json!({"default": "yes"}))
                .send()
                .await
                .unwrap(),
            "default",
        )
        .await;
        let removed = app.admin(Method::DELETE, &path).send().await.unwrap();
        assert_eq!(removed.status(), StatusCode::NO_CONTENT);
        let again = app.admin(Method::DELETE, &path).send().await.unwrap();
        assert_eq!(again.status(), StatusCode::NOT_FOUND);
        expect_field_error(
            app.send(&acme, &with(email(), "sender_id", mails["id"].clone()))
                .await,
            "sender_id",
        )
        .await;
        // Deleting the tenant removes its identities with it.
        let gone = app.admin(Method::DELETE, "/v1/admin/tenants/globex").send().await.unwrap();
        assert_eq!(gone.status(), StatusCode::NO_CONTENT);
        app.tenant_with_key("globex", "pro").await;
        let fresh = listed_senders(&app, "globex").await;
        assert_eq!(ids(&fresh), Vec::<&str>::new());
    }
}

/// In a batch each item's `sender_id` is checked alone: a foreign one
/// refuses that item, naming the field, and the others are accepted with
/// their identities.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_checks_each_items_sender_id() {
    let sms_api = MockServer::start().await;
    mock_sms_ok(&sms_api, "SM-BATCH").await;
    let app = TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
    let acme = app.tenant_with_key("acme", "pro").await;
    app.tenant_with_key("globex", "pro").await;
    let ours = add_sender(&app, "acme", json!({"channel": "sms", "from": "ACME"})).await;
    let theirs = add_sender(&app, "globex", json!({"channel": "sms", "from": "GLOBEX"})).await;
    let batch = json!({"messages": [
        with(sms(), "sender_id", ours["id"].clone()),
        with(sms(), "sender_id", theirs["id"].clone()),
        sms(),
    ]});
    let answer = expect_json(
        crate::batch::post_batch(&app, &acme, &batch).await,
        StatusCode::OK,
    )
    .await;
    crate::batch::assert_item_names_field(&answer, 1, "sender_id");
    let accepted = crate::batch::accepted_ids(&answer);
    assert_eq!(accepted.len(), 2, "{answer}");
    for id in &accepted {
        wait_for(&app, &acme, id, status_is("sent")).await;
    }
    let forms: Vec<String> = sms_api
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|request| String::from_utf8_lossy(&request.body).into_owned())
        .collect();
    assert_eq!(forms.len(), 2, "{forms:?}");
    assert!(forms.iter().any(|f| f.contains("From=ACME")), "{forms:?}");
    assert!(
        forms.iter().any(|f| f.contains("From=%2B15550001111")),
        "{forms:?}"
    );
    assert!(!forms.iter().any(|f| f.contains("GLOBEX")), "{forms:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_outlive_a_restart_on_sqlite() {
    let app = TestApp::start("").await;
    app.tenant_with_key("acme", "pro").await;
    let made = add_sender(
        &app,
        "acme",
        json!({"channel": "sms", "from": "+15550002222", "default": true}),
    )
    .await;
    let dir = app.stop().await;
    let app = TestApp::start_in(dir, "", |_| {}).await;
    let listed = listed_senders(&app, "acme").await;
    assert_eq!(listed["senders"][0], made, "{listed}");
}

/// SES answers every send with a fresh id.
pub(crate) async fn ses_ok() -> MockServer {
    let ses = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v2/email/outbound-emails"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({"MessageId": "ses-1"})))
        .mount(&ses)
        .await;
    ses
}

/// The JSON of each SendEmail call SES received, in order.
pub(crate) async fn ses_calls(ses: &MockServer) -> Vec<Value> {
    ses.received_requests()
        .await
        .unwrap()
        .iter()
        .map(|request| serde_json::from_slice(&request.body).unwrap())
        .collect()
}

/// What an SES SendEmail call carried as its raw MIME message, parsed
/// back with a MIME parser.
#[derive(Debug, Default)]
pub(crate) struct SentMail {
    pub subject: Option<String>,
    pub from: Option<(Option<String>, String)>,
    pub to: Vec<String>,
    pub cc: Vec<String>,
    pub reply_to: Vec<String>,
    /// `type/subtype` of the message's body.
    pub content_type: String,
    pub text: Option<String>,
    pub html: Option<String>,
    /// Every header, name and unfolded value, in order.
    pub headers: Vec<(String, String)>,
    /// The whole raw message.
    pub raw: Vec<u8>,
}

impl SentMail {
    /// The value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The MIME message of an SES SendEmail call (`Content.Raw.Data`).
pub(crate) fn mail_of(call: &Value) -> SentMail {
    use base64::Engine;
    use mail_parser::{Address, MessageParser, MimeHeaders};
    let data = call["Content"]["Raw"]["Data"]
        .as_str()
        .unwrap_or_else(|| panic!("a raw message: {call}"));
    let raw = base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("base64");
    let mail = MessageParser::default()
        .parse(&raw)
        .expect("a parseable MIME message");
    let list = |addresses: Option<&Address>| -> Vec<String> {
        addresses
            .map(|a| {
                a.iter()
                    .filter_map(|a| a.address().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let headers = raw
        .split(|b| *b == b'\n')
        .take_while(|line| line.len() > 1)
        .map(|line| String::from_utf8_lossy(line).trim_end().to_owned())
        .fold(Vec::<String>::new(), |mut lines, line| {
            match (line.starts_with([' ', '\t']), lines.last_mut()) {
                (true, Some(last)) => last.push_str(&line),
                _ => lines.push(line),
            }
            lines
        })
        .into_iter()
        .filter_map(|line| {
            let (name, _) = line.split_once(':')?;
            let value = mail
                .header_raw(name)
                .map(|v| v.trim().replace("\r\n", "").replace('\n', ""))
                .unwrap_or_default();
            Some((name.to_owned(), value))
        })
        .collect();
    SentMail {
        subject: mail.subject().map(str::to_owned),
        from: mail.from().and_then(|a| a.first()).map(|a| {
            (
                a.name().map(str::to_owned),
                a.address().unwrap_or_default().to_owned(),
            )
        }),
        to: list(mail.to()),
        cc: list(mail.cc()),
        reply_to: list(mail.reply_to()),
        content_type: mail
            .content_type()
            .map(|c| format!("{}/{}", c.ctype(), c.subtype().unwrap_or("")))
            .unwrap_or_default(),
        text: mail.body_text(0).map(|t| t.into_owned()),
        html: mail.body_html(0).map(|t| t.into_owned()),
        headers,
        raw: raw.clone(),
    }
}

fn tag<'a>(call: &'a Value, name: &str) -> Option<&'a str> {
    call["EmailTags"]
        .as_array()?
        .iter()
        .find(|tag| tag["Name"] == name)
        .and_then(|tag| tag["Value"].as_str())
}

on_both_stores! {
    /// The tenant's default email identity gives SES its from (with the
    /// display name), reply-to and configuration set; every call carries
    /// the tenant as `TenantName` (`ses_tenants = true`) and the tenant and
    /// message id as tags. A tenant without identities sends as configured.
    async fn an_email_goes_out_with_the_tenants_identity_tenant_name_and_tags() {
        let ses = ses_ok().await;
        let settings = delivery_settings("http://127.0.0.1:9", &ses.uri(), "");
        let app = TestApp::start_custom(&settings, |settings| {
            let fairlane::config::ProviderKind::Ses(ses) = &mut settings.providers.email.kind else {
                panic!("the delivery settings give email an SES provider");
            };
            ses.ses_tenants = true;
        })
        .await;
        let acme = app.tenant_with_key("acme", "pro").await;
        let plain = app.tenant_with_key("plain", "pro").await;
        add_sender(
            &app,
            "acme",
            json!({"channel": "email", "from": "news@acme.example", "display_name": "Acme \"News\"",
                   "reply_to": ["help@acme.example", "sales@acme.example"],
                   "configuration_set": "acme-events", "default": true}),
        )
        .await;
        let ours = app.send_accepted(&acme, &email()).await;
        wait_for(&app, &acme, &ours, status_is("sent")).await;
        let configured = app.send_accepted(&plain, &email()).await;
        wait_for(&app, &plain, &configured, status_is("sent")).await;

        let calls = ses_calls(&ses).await;
        assert_eq!(calls.len(), 2, "{calls:?}");
        let call = &calls[0];
        assert_eq!(
            call["FromEmailAddress"],
            "\"Acme \\\"News\\\"\" <news@acme.example>",
            "{call}"
        );
        let mail = mail_of(call);
        assert_eq!(
            mail.from,
            Some((Some("Acme \"News\"".to_owned()), "news@acme.example".to_owned()))
        );
        assert_eq!(mail.reply_to, ["help@acme.example", "sales@acme.example"]);
        assert_eq!(call["ConfigurationSetName"], "acme-events");
        assert_eq!(call["TenantName"], "acme");
        assert_eq!(tag(call, "tenant"), Some("acme"), "{call}");
        assert_eq!(tag(call, "message_id"), Some(ours.as_str()), "{call}");

        let call = &calls[1];
        assert_eq!(call["FromEmailAddress"], "noreply@example.com", "{call}");
        assert!(mail_of(call).reply_to.is_empty(), "{call}");
        assert!(call.get("ConfigurationSetName").is_none(), "{call}");
        assert_eq!(call["TenantName"], "plain");
        assert_eq!(tag(call, "message_id"), Some(configured.as_str()), "{call}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ses_tenants_no_tenant_name_is_sent() {
    let ses = ses_ok().await;
    let app = TestApp::start(&delivery_settings("http://127.0.0.1:9", &ses.uri(), "")).await;
    let acme = app.tenant_with_key("acme", "pro").await;
    let id = app.send_accepted(&acme, &email()).await;
    wait_for(&app, &acme, &id, status_is("sent")).await;
    let calls = ses_calls(&ses).await;
    assert!(calls[0].get("TenantName").is_none(), "{}", calls[0]);
    assert_eq!(tag(&calls[0], "tenant"), Some("acme"));
}

on_both_stores! {
    /// An SMS identity's sender replaces the configured `From`; a
    /// messaging-service identity sends `MessagingServiceSid` and no `From`.
    async fn an_sms_goes_out_with_the_tenants_sender_or_messaging_service() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM-ID-1").await;
        let app =
            TestApp::start(&delivery_settings(&sms_api.uri(), "http://127.0.0.1:9", "")).await;
        let acme = app.tenant_with_key("acme", "pro").await;
        add_sender(&app, "acme", json!({"channel": "sms", "from": "ACME", "default": true})).await;
        let service = format!("MG{}", "0123456789abcdef".repeat(2));
        let pooled = add_sender(
            &app,
            "acme",
            json!({"channel": "sms", "messaging_service_sid": service}),
        )
        .await;
        let first = app.send_accepted(&acme, &sms()).await;
        wait_for(&app, &acme, &first, status_is("sent")).await;
        let second = app
            .send_accepted(&acme, &with(sms(), "sender_id", pooled["id"].clone()))
            .await;
        wait_for(&app, &acme, &second, status_is("sent")).await;

        let forms: Vec<String> = sms_api
            .received_requests()
            .await
            .unwrap()
            .iter()
            .map(|request| String::from_utf8_lossy(&request.body).into_owned())
            .collect();
        assert_eq!(forms.len(), 2, "{forms:?}");
        assert!(forms[0].contains("From=ACME"), "{}", forms[0]);
        assert!(!forms[0].contains("MessagingServiceSid"), "{}", forms[0]);
        assert!(
            forms[1].contains(&format!("MessagingServiceSid={service}")),
            "{}",
            forms[1]
        );
        assert!(!forms[1].contains("From="), "{}", forms[1]);
    }
}
