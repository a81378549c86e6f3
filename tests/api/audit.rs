//! Named admins with roles, and the audit log of every admin change: a
//! viewer reads and cannot change, an operator changes and cannot manage
//! admins, and each change is listed with the admin that made it, secrets
//! never.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::{TestApp, expect_field_error, expect_json, expect_problem, on_both_stores};
use fairlane::model::now_ms;
use fairlane::scheduler::Retention;
use fairlane::store::admins::{AuditQuery, AuditRow};

/// Adds an admin as root; its token.
async fn add_admin(app: &TestApp, name: &str, role: &str) -> String {
    let response = app
        .admin(Method::POST, "/v1/admin/admins")
        .json(&json!({"name": name, "role": role}))
        .send()
        .await
        .unwrap();
    let body = expect_json(response, StatusCode::CREATED).await;
    assert_eq!(body["name"], name);
    assert_eq!(body["role"], role);
    body["token"].as_str().unwrap().to_owned()
}

/// A request with an admin's own token.
fn as_admin(app: &TestApp, token: &str, method: Method, path: &str) -> reqwest::RequestBuilder {
    app.tenant(token, method, path)
}

/// The whole audit log, read a page of `page` at a time as `token`.
async fn whole_log(app: &TestApp, token: &str, filter: &str, page: u32) -> Vec<Value> {
    let mut entries = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/v1/admin/audit?limit={page}{filter}");
        if let Some(cursor) = &cursor {
            path.push_str(&format!("&cursor={cursor}"));
        }
        let response = as_admin(app, token, Method::GET, &path)
            .send()
            .await
            .unwrap();
        let body = expect_json(response, StatusCode::OK).await;
        entries.extend(body["entries"].as_array().unwrap().iter().cloned());
        match body["next"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => return entries,
        }
    }
}

/// `(actor, action)` of each entry, oldest first.
fn who_did_what(entries: &[Value]) -> Vec<(String, String)> {
    entries
        .iter()
        .rev()
        .map(|entry| {
            (
                entry["actor"]["name"].as_str().unwrap().to_owned(),
                entry["action"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

on_both_stores! {
    async fn each_role_does_what_it_may_and_the_log_names_who_changed_what() {
        let app = TestApp::start("").await;
        let desk = add_admin(&app, "desk", "viewer").await;
        let ops = add_admin(&app, "ops", "operator").await;

        // The operator changes things.
        let created = as_admin(&app, &ops, Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": "acme", "name": "Acme", "plan": "basic"}))
            .send()
            .await
            .unwrap();
        expect_json(created, StatusCode::CREATED).await;
        let paused = as_admin(&app, &ops, Method::PATCH, "/v1/admin/tenants/acme")
            .json(&json!({"status": "paused"}))
            .send()
            .await
            .unwrap();
        expect_json(paused, StatusCode::OK).await;
        let issued = as_admin(&app, &ops, Method::POST, "/v1/admin/tenants/acme/keys")
            .send()
            .await
            .unwrap();
        let issued = expect_json(issued, StatusCode::CREATED).await;
        let key = issued["key"].as_str().unwrap().to_owned();

        // The viewer reads, and every change it tries is refused before it
        // is made.
        let read = as_admin(&app, &desk, Method::GET, "/v1/admin/tenants/acme")
            .send()
            .await
            .unwrap();
        expect_json(read, StatusCode::OK).await;
        for (method, path, body) in [
            (Method::POST, "/v1/admin/tenants", json!({"id": "evil", "plan": "basic"})),
            (Method::PATCH, "/v1/admin/tenants/acme", json!({"status": "active"})),
            (Method::PUT, "/v1/admin/plans/basic", json!({})),
            (Method::POST, "/v1/admin/dlq/redrive", json!({})),
            (Method::POST, "/v1/admin/admins", json!({"name": "x", "role": "owner"})),
        ] {
            let response = as_admin(&app, &desk, method, path).json(&body).send().await.unwrap();
            expect_problem(response, StatusCode::FORBIDDEN).await;
        }
        let revoke = format!("/v1/admin/tenants/acme/keys/{}", issued["id"].as_str().unwrap());
        let response = as_admin(&app, &desk, Method::DELETE, &revoke).send().await.unwrap();
        expect_problem(response, StatusCode::FORBIDDEN).await;
        let tenant = expect_json(
            app.admin(Method::GET, "/v1/admin/tenants/acme").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        assert_eq!(tenant["status"], "paused", "the viewer's PATCH changed nothing");
        let evil = app.admin(Method::GET, "/v1/admin/tenants/evil").send().await.unwrap();
        expect_problem(evil, StatusCode::NOT_FOUND).await;

        // The operator cannot manage admins; only an owner can.
        let response = as_admin(&app, &ops, Method::POST, "/v1/admin/admins")
            .json(&json!({"name": "mine", "role": "owner"}))
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::FORBIDDEN).await;
        let response = as_admin(&app, &ops, Method::GET, "/v1/admin/admins").send().await.unwrap();
        expect_problem(response, StatusCode::FORBIDDEN).await;

        // The log, read by the viewer two entries a page: each change once,
        // with its admin, and none of the refused attempts.
        let log = whole_log(&app, &desk, "", 2).await;
        let expected: Vec<(String, String)> = [
            ("root", "POST /v1/admin/admins"),
            ("root", "POST /v1/admin/admins"),
            ("ops", "POST /v1/admin/tenants"),
            ("ops", "PATCH /v1/admin/tenants/{id}"),
            ("ops", "POST /v1/admin/tenants/{id}/keys"),
        ]
        .iter()
        .map(|(who, what)| (who.to_string(), what.to_string()))
        .collect();
        assert_eq!(who_did_what(&log), expected);
        let ids: Vec<i64> = log.iter().map(|entry| entry["id"].as_i64().unwrap()).collect();
        assert!(ids.windows(2).all(|pair| pair[0] > pair[1]), "newest first: {ids:?}");

        // Before and after, secrets never.
        let patch = &log[1];
        assert_eq!(patch["target"], "/v1/admin/tenants/acme");
        assert_eq!(patch["actor"]["role"], "operator");
        assert_eq!(patch["before"]["status"], "active");
        assert_eq!(patch["after"]["status"], "paused");
        assert_eq!(log[0]["after"]["key"], "[redacted]");
        let everything = serde_json::to_string(&log).unwrap();
        assert!(!everything.contains(&key), "a tenant key reached the log");
        assert!(!everything.contains(&ops), "an admin token reached the log");
        assert!(!everything.contains(&desk), "an admin token reached the log");

        // Filters.
        let by_ops = whole_log(&app, &desk, "&actor=ops", 100).await;
        assert_eq!(by_ops.len(), 3);
        let on_acme = whole_log(&app, &desk, "&target=/v1/admin/tenants/acme", 100).await;
        assert_eq!(on_acme.len(), 2, "PATCH and key: {on_acme:?}");
        let posts = whole_log(&app, &desk, "&action=POST", 100).await;
        assert_eq!(posts.len(), 4);
        let future = whole_log(&app, &desk, "&since=2999-01-01T00:00:00Z", 100).await;
        assert!(future.is_empty());

        // A revoked admin's token stops working at once; the revoke is
        // logged with the admin it removed.
        let listed = expect_json(
            app.admin(Method::GET, "/v1/admin/admins").send().await.unwrap(),
            StatusCode::OK,
        )
        .await;
        let desk_id = listed["admins"]
            .as_array()
            .unwrap()
            .iter()
            .find(|admin| admin["name"] == "desk")
            .unwrap()["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let response = app
            .admin(Method::DELETE, &format!("/v1/admin/admins/{desk_id}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NO_CONTENT);
        let response = as_admin(&app, &desk, Method::GET, "/v1/admin/tenants").send().await.unwrap();
        expect_problem(response, StatusCode::UNAUTHORIZED).await;
        let log = whole_log(&app, &ops, "&action=DELETE", 100).await;
        assert_eq!(log.len(), 1);
        assert_eq!(log[0]["before"]["name"], "desk");
        assert_eq!(log[0]["actor"]["name"], "root");
        let response = app
            .admin(Method::DELETE, &format!("/v1/admin/admins/{desk_id}"))
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
    }
}

on_both_stores! {
    async fn bad_admin_and_audit_input_is_a_clear_error_naming_the_field() {
        let app = TestApp::start("").await;
        add_admin(&app, "ops", "operator").await;
        for (body, field) in [
            (json!({"name": "boss", "role": "king"}), "role"),
            (json!({"name": "a b", "role": "viewer"}), "name"),
            (json!({"name": "root", "role": "viewer"}), "name"),
            (json!({"name": "x", "role": "viewer", "extra": 1}), "extra"),
        ] {
            let response = app.admin(Method::POST, "/v1/admin/admins").json(&body).send().await.unwrap();
            expect_field_error(response, field).await;
        }
        let response = app
            .admin(Method::POST, "/v1/admin/admins")
            .json(&json!({"name": "ops", "role": "viewer"}))
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::CONFLICT).await;
        for (query, field) in [
            ("limit=0", "limit"),
            ("limit=501", "limit"),
            ("since=yesterday", "since"),
            ("cursor=abc", "cursor"),
        ] {
            let response = app
                .admin(Method::GET, &format!("/v1/admin/audit?{query}"))
                .send()
                .await
                .unwrap();
            expect_field_error(response, field).await;
        }
        let response = app
            .admin(Method::GET, "/v1/admin/audit?colour=red")
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::BAD_REQUEST).await;
        // A tenant key is no admin token.
        let key = app.tenant_with_key("acme", "basic").await;
        let response = app.tenant(&key, Method::GET, "/v1/admin/audit").send().await.unwrap();
        expect_problem(response, StatusCode::FORBIDDEN).await;
    }
}

on_both_stores! {
    async fn the_retention_job_removes_audit_entries_past_their_days() {
        let app = TestApp::start("").await;
        let day = 86_400_000;
        let entry = |at: i64, target: &str| AuditRow {
            id: 0,
            at,
            actor_id: "root".into(),
            actor_name: "root".into(),
            actor_role: "owner".into(),
            action: "POST /v1/admin/tenants".into(),
            target: target.into(),
            status: 201,
            before: None,
            after: None,
        };
        let now = now_ms();
        app.state.db.record_audit(&entry(now - 40 * day, "/old")).await.unwrap();
        app.state.db.record_audit(&entry(now - 20 * day, "/kept")).await.unwrap();
        let job = Retention {
            db: app.state.db.clone(),
            registry: app.state.registry.clone(),
            queues: app.state.tenant_queues.clone(),
            batch: 10,
            vacuum: false,
            audit_days: 30,
        };
        let mut run = None;
        for _ in 0..100 {
            run = job.run_once(now).await.unwrap();
            if run.is_some() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert_eq!(run.expect("a retention run").audit_pruned, 1);
        let left = app
            .state
            .db
            .audit_page(&AuditQuery { limit: 10, ..AuditQuery::default() })
            .await
            .unwrap();
        let targets: Vec<&str> = left.iter().map(|row| row.target.as_str()).collect();
        assert_eq!(targets, ["/kept"]);
    }
}
