//! The message list: a tenant's own messages newest first, filtered and
//! paged; live and test messages apart; the admin's view of any tenant.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{
    TestApp, email, expect_field_error, expect_json, expect_problem, on_both_stores, sms, with,
};
use crate::test_keys::issue;

async fn list(app: &TestApp, key: &str, query: &str) -> Value {
    expect_json(
        app.tenant(key, Method::GET, &format!("/v1/messages{query}"))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await
}

fn ids(page: &Value) -> Vec<String> {
    page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every id of a list, page by page of `limit`.
async fn all_pages(app: &TestApp, key: &str, filter: &str, limit: usize) -> Vec<String> {
    let mut found = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..100 {
        let mut query = format!("?limit={limit}{filter}");
        if let Some(cursor) = &cursor {
            query.push_str(&format!("&cursor={cursor}"));
        }
        let page = list(app, key, &query).await;
        let got = ids(&page);
        assert!(got.len() <= limit, "{page}");
        found.extend(got);
        match page["next"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return found,
        }
    }
    panic!("the list did not end");
}

on_both_stores! {
    async fn a_tenant_lists_its_own_messages_newest_first_filtered_and_paged() {
        let app = TestApp::start("[consumers]\nenabled = false\n").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let other = app.tenant_with_key("globex", "pro").await;
        let later = (chrono::Utc::now() + chrono::Duration::hours(1)).to_rfc3339();
        let bodies = [
            with(sms(), "reference", json!("r1")),
            with(email(), "reference", json!("r2")),
            with(sms(), "reference", json!("r1")),
            with(with(email(), "reference", json!("r2")), "send_at", json!(later)),
            with(sms(), "reference", json!("r1")),
        ];
        let mut sent = Vec::new();
        for body in &bodies {
            sent.push(app.send_accepted(&key, body).await);
            // Distinct creation times, so since/until split them.
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        app.send_accepted(&other, &sms()).await;
        let newest_first: Vec<String> = sent.iter().rev().cloned().collect();

        let everything = list(&app, &key, "").await;
        assert_eq!(ids(&everything), newest_first);
        assert!(everything.get("next").is_none(), "{everything}");
        assert_eq!(everything["messages"][0]["reference"], "r1");
        for limit in [1, 2, 3] {
            assert_eq!(all_pages(&app, &key, "", limit).await, newest_first, "limit {limit}");
        }
        assert_eq!(
            all_pages(&app, &key, "&reference=r1", 2).await,
            [&sent[4], &sent[2], &sent[0]].map(String::clone)
        );
        assert_eq!(
            ids(&list(&app, &key, "?channel=email").await),
            [&sent[3], &sent[1]].map(String::clone)
        );
        assert_eq!(
            ids(&list(&app, &key, "?status=scheduled&reference=r2").await),
            [sent[3].clone()]
        );
        // since/until on the creation times of the second and fourth.
        let created = |i: usize| {
            everything["messages"][4 - i]["created_at"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        let window = format!(
            "?since={}&until={}",
            urlencode(&created(1)),
            urlencode(&created(3))
        );
        assert_eq!(
            ids(&list(&app, &key, &window).await),
            [&sent[2], &sent[1]].map(String::clone)
        );

        // Bad filters are refused naming the parameter.
        for (query, field) in [
            ("?limit=0", "limit"),
            ("?limit=1001", "limit"),
            ("?status=lost", "status"),
            ("?channel=fax", "channel"),
            ("?since=yesterday", "since"),
            ("?cursor=nonsense", "cursor"),
            ("?reference=", "reference"),
        ] {
            expect_field_error(
                app.tenant(&key, Method::GET, &format!("/v1/messages{query}"))
                    .send()
                    .await
                    .unwrap(),
                field,
            )
            .await;
        }
        expect_problem(
            app.tenant(&key, Method::GET, "/v1/messages?colour=red")
                .send()
                .await
                .unwrap(),
            StatusCode::BAD_REQUEST,
        )
        .await;

        // A test key's messages are listed with a test key only; the admin
        // sees either kind of any tenant.
        let test_key = issue(&app, "acme", Some("test")).await["key"]
            .as_str()
            .unwrap()
            .to_owned();
        let trial = app.send_accepted(&test_key, &sms()).await;
        assert_eq!(ids(&list(&app, &test_key, "").await), std::slice::from_ref(&trial));
        assert_eq!(ids(&list(&app, &key, "").await), newest_first);
        expect_field_error(
            app.tenant(&key, Method::GET, "/v1/messages?test=true")
                .send()
                .await
                .unwrap(),
            "test",
        )
        .await;
        let admin_live = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/messages?limit=2")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(ids(&admin_live), newest_first[..2]);
        assert!(admin_live["next"].is_string(), "{admin_live}");
        let admin_test = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme/messages?test=true")
                .send()
                .await
                .unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(ids(&admin_test), [trial]);
        expect_problem(
            app.admin(Method::GET, "/v1/admin/tenants/nobody/messages")
                .send()
                .await
                .unwrap(),
            StatusCode::NOT_FOUND,
        )
        .await;
    }
}

on_both_stores! {
    /// Issue 46: a status or channel filter reads at most
    /// `limits.list_scan_rows` messages a page. A rare status answers short
    /// pages (even empty ones) with a `next` until the tenant's last
    /// message, and the pages together hold every match in order.
    async fn a_rare_status_is_found_through_bounded_pages_that_say_where_to_go_on() {
        let app = TestApp::start(
            "[consumers]\nenabled = false\n[limits]\nlist_scan_rows = 4\n",
        )
        .await;
        let key = app.tenant_with_key("acme", "pro").await;
        for _ in 0..10 {
            app.send_accepted(&key, &sms()).await;
        }
        // The list's own order (ids made in one millisecond sort by id).
        let order = all_pages(&app, &key, "", 100).await;
        assert_eq!(order.len(), 10);
        for cancelled in [&order[1], &order[8]] {
            let response = app
                .tenant(&key, Method::DELETE, &format!("/v1/messages/{cancelled}"))
                .send()
                .await
                .unwrap();
            assert!(response.status().is_success(), "{}", response.status());
        }

        // Page by page: the first scan (messages 0-3) finds message 1, the
        // second (4-7) nothing, the third (8-9) message 8 and ends the list.
        let mut pages = Vec::new();
        let mut query = "?status=cancelled".to_owned();
        loop {
            let page = list(&app, &key, &query).await;
            pages.push(ids(&page));
            match page["next"].as_str() {
                Some(next) => query = format!("?status=cancelled&cursor={next}"),
                None => break,
            }
            assert!(pages.len() < 10, "the list did not end: {pages:?}");
        }
        assert_eq!(
            pages,
            vec![vec![order[1].clone()], vec![], vec![order[8].clone()]]
        );

        // A channel none has: empty pages that go on, then the end.
        let mut empty_pages = 0;
        let mut query = "?channel=email".to_owned();
        loop {
            let page = list(&app, &key, &query).await;
            assert!(ids(&page).is_empty(), "{page}");
            empty_pages += 1;
            match page["next"].as_str() {
                Some(next) => query = format!("?channel=email&cursor={next}"),
                None => break,
            }
            assert!(empty_pages < 10, "the list did not end");
        }
        assert_eq!(empty_pages, 3);

        // A common status fills its pages within the scan, and the pages
        // hold every match once, in order.
        let queued: Vec<String> = order
            .iter()
            .filter(|id| **id != order[1] && **id != order[8])
            .cloned()
            .collect();
        assert_eq!(all_pages(&app, &key, "&status=queued", 2).await, queued);
    }
}

fn urlencode(text: &str) -> String {
    text.replace('+', "%2B").replace(':', "%3A")
}

on_both_stores! {
    /// An SMS's status says how many fragments its text is billed as,
    /// counted when it was accepted; an email has none.
    async fn an_sms_status_carries_its_fragment_count() {
        let app = TestApp::start("[consumers]\nenabled = false\n").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for (text, fragments) in [
            ("a".repeat(160), 1),
            ("a".repeat(161), 2),
            (format!("{}€", "a".repeat(159)), 2),
            (format!("{}😀", "a".repeat(69)), 2),
        ] {
            let id = app.send_accepted(&key, &with(sms(), "text", json!(text))).await;
            let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
            assert_eq!(view["fragments"], fragments, "{view}");
        }
        let id = app.send_accepted(&key, &email()).await;
        let view = expect_json(app.get_message(&key, &id).await, StatusCode::OK).await;
        assert!(view.get("fragments").is_none(), "{view}");
    }
}

/// Issue 46: a tenant's list reads take its turns (`limits.tenant_list_reads`).
/// With its one turn held, its next list read waits half the request
/// timeout and is a 429 with Retry-After; another tenant's list and status
/// reads are answered meanwhile; once the turn is back, the list answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_list_reads_wait_for_its_own_turns_and_no_other_tenants() {
    let app = TestApp::start_custom("[limits]\ntenant_list_reads = 1\n", |settings| {
        settings.server.request_timeout_secs = 2;
    })
    .await;
    let key = app.tenant_with_key("acme", "pro").await;
    let other = app.tenant_with_key("globex", "pro").await;
    let id = app.send_accepted(&other, &sms()).await;
    let held = app.state.reads.take("acme").await.expect("acme's one turn");

    let started = std::time::Instant::now();
    let refused = app
        .tenant(&key, Method::GET, "/v1/messages")
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    let (headers, _) = crate::support::expect_problem_kind(
        refused,
        StatusCode::TOO_MANY_REQUESTS,
        "too-many-reads",
    )
    .await;
    assert!(crate::support::header_u64(&headers, "retry-after") >= 1);
    assert!(
        waited >= std::time::Duration::from_millis(900),
        "it waited its turn first: {waited:?}"
    );
    // The other tenant is not held by acme's turns.
    assert_eq!(
        ids(&list(&app, &other, "").await),
        std::slice::from_ref(&id)
    );
    let view = expect_json(app.get_message(&other, &id).await, StatusCode::OK).await;
    assert_eq!(view["id"], id.as_str());

    drop(held);
    let page = list(&app, &key, "").await;
    assert!(ids(&page).is_empty(), "{page}");
}

on_both_stores! {
    async fn the_list_finds_a_recipients_messages_however_the_address_is_written() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let ann = app.send_accepted(&key, &with(crate::support::email(), "to", json!("Ann@Example.com"))).await;
        let bob = app.send_accepted(&key, &with(sms(), "to", json!("+15550002222"))).await;
        for (query, expected) in [("ann%40example.COM", &ann), ("%2B15550002222", &bob)] {
            let listed = expect_json(
                app.tenant(&key, Method::GET, &format!("/v1/messages?recipient={query}")).send().await.unwrap(),
                StatusCode::OK,
            )
            .await;
            let ids: Vec<&str> = listed["messages"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
            assert_eq!(ids, [expected.as_str()], "{query}: {listed}");
        }
        let refused = app.tenant(&key, Method::GET, "/v1/messages?recipient=nobody").send().await.unwrap();
        expect_field_error(refused, "recipient").await;
    }
}
