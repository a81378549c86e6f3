//! The admin API: plans, tenants (status and plan changes take effect on
//! the next send) and keys.

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::*;

fn plan_body() -> Value {
    json!({"lane": "slow", "rate_per_second": 2.5, "burst": 5, "daily_quota": 500, "max_in_flight": 2})
}

on_both_stores! {
    async fn a_disabled_tenant_is_refused_with_403_until_reactivated() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;

        let tenant = app
            .patch_tenant("acme", json!({"status": "disabled"}))
            .await;
        assert_eq!(tenant["status"], "disabled");
        let response = app.send(&key, &email()).await;
        expect_problem_kind(response, StatusCode::FORBIDDEN, "forbidden").await;

        app.patch_tenant("acme", json!({"status": "active"})).await;
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::ACCEPTED
        );
    }
}

on_both_stores! {
    async fn a_paused_tenant_can_still_send() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let tenant = app.patch_tenant("acme", json!({"status": "paused"})).await;
        assert_eq!(tenant["status"], "paused");
        let accepted = expect_json(app.send(&key, &email()).await, StatusCode::ACCEPTED).await;
        assert_eq!(accepted["status"], "queued");
    }
}

on_both_stores! {
    async fn the_configured_plans_are_listed() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::GET, "/v1/admin/plans")
            .send()
            .await
            .unwrap();
        let body = expect_json(response, StatusCode::OK).await;
        let plans = body["plans"].as_array().expect("plans array");
        let names: Vec<&str> = plans.iter().filter_map(|p| p["name"].as_str()).collect();
        for name in ["basic", "pro", "enterprise"] {
            assert!(names.contains(&name), "{name} missing from {names:?}");
        }
        let basic = plans.iter().find(|p| p["name"] == "basic").unwrap();
        assert_eq!(basic["lane"], "slow");
        assert_eq!(basic["burst"], 10);
        assert_eq!(basic["daily_quota"], 10000);
    }
}

on_both_stores! {
    async fn putting_a_plan_creates_it_then_replaces_it() {
        let app = TestApp::start("").await;
        let created = app
            .admin(Method::PUT, "/v1/admin/plans/starter")
            .json(&plan_body())
            .send()
            .await
            .unwrap();
        assert_eq!(
            header(created.headers(), "location"),
            Some("/v1/admin/plans/starter")
        );
        let created = expect_json(created, StatusCode::CREATED).await;
        assert_eq!(created["name"], "starter");
        assert_eq!(created["rate_per_second"], 2.5);
        // Left out, a plan's upload limits are the defaults.
        assert_eq!(created["uploads_per_minute"], 60, "{created}");
        assert_eq!(created["upload_bytes_held"], 1_073_741_824_u64, "{created}");

        let replaced = app
            .admin(Method::PUT, "/v1/admin/plans/starter")
            .json(&with(with(with(plan_body(), "burst", json!(7)), "uploads_per_minute", json!(5)), "upload_bytes_held", json!(1000)))
            .send()
            .await
            .unwrap();
        let replaced = expect_json(replaced, StatusCode::OK).await;
        assert_eq!(replaced["burst"], 7);
        assert_eq!((&replaced["uploads_per_minute"], &replaced["upload_bytes_held"]), (&json!(5), &json!(1000)));

        let fetched = app
            .admin(Method::GET, "/v1/admin/plans/starter")
            .send()
            .await
            .unwrap();
        let fetched = expect_json(fetched, StatusCode::OK).await;
        assert_eq!(fetched, replaced);
    }
}

on_both_stores! {
    async fn a_plan_with_an_unknown_field_is_a_422_naming_it() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::PUT, "/v1/admin/plans/starter")
            .json(&with(plan_body(), "brust", json!(5)))
            .send()
            .await
            .unwrap();
        expect_field_error(response, "brust").await;
        let missing = app
            .admin(Method::GET, "/v1/admin/plans/starter")
            .send()
            .await
            .unwrap();
        expect_problem(missing, StatusCode::NOT_FOUND).await;
    }
}

on_both_stores! {
    async fn a_plan_with_impossible_figures_is_a_422() {
        let app = TestApp::start("").await;
        let cases = [
            ("rate_per_second", json!(0)),
            ("rate_per_second", json!(-1.0)),
            // A typo that once panicked every send of the plan's tenants.
            ("rate_per_second", json!(1e-20)),
            ("rate_per_second", json!(0.000_9)),
            ("rate_per_second", json!(1_000_001.0)),
            ("burst", json!(0)),
            ("max_in_flight", json!(0)),
            ("uploads_per_minute", json!(0)),
            ("uploads_per_minute", json!(1_000_001)),
            ("uploads_per_minute", json!(2.5)),
            ("upload_bytes_held", json!(-1)),
        ];
        for (field, value) in cases {
            let response = app
                .admin(Method::PUT, "/v1/admin/plans/starter")
                .json(&with(plan_body(), field, value.clone()))
                .send()
                .await
                .unwrap();
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            assert_eq!(
                status,
                StatusCode::UNPROCESSABLE_ENTITY,
                "{field} = {value}: {body}"
            );
            assert!(
                body["errors"].get(field).is_some(),
                "{field} = {value}: {body}"
            );
        }
        let wrong_type = app
            .admin(Method::PUT, "/v1/admin/plans/starter")
            .json(&with(plan_body(), "lane", json!("medium")))
            .send()
            .await
            .unwrap();
        expect_field_error(wrong_type, "lane").await;
        let missing = app
            .admin(Method::PUT, "/v1/admin/plans/starter")
            .json(&with(plan_body(), "burst", Value::Null))
            .send()
            .await
            .unwrap();
        expect_field_error(missing, "burst").await;
    }
}

on_both_stores! {
    async fn the_slowest_plan_rate_is_one_send_in_1000_seconds_and_its_tenants_send() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::PUT, "/v1/admin/plans/tiny")
            .json(&with(plan_body(), "rate_per_second", json!(0.001)))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        let key = app.tenant_with_key("acme", "tiny").await;
        assert_eq!(app.send(&key, &email()).await.status(), StatusCode::ACCEPTED);
    }
}

on_both_stores! {
    async fn a_plan_with_an_invalid_name_is_a_422_naming_name() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::PUT, "/v1/admin/plans/Gold%20Plan")
            .json(&plan_body())
            .send()
            .await
            .unwrap();
        expect_field_error(response, "name").await;
    }
}

on_both_stores! {
    async fn an_unknown_plan_is_not_found() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::GET, "/v1/admin/plans/nope")
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
    }
}

on_both_stores! {
    async fn a_tenant_on_an_unknown_plan_is_a_422_naming_plan() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": "acme", "name": "Acme", "plan": "platinum"}))
            .send()
            .await
            .unwrap();
        expect_field_error(response, "plan").await;
    }
}

on_both_stores! {
    async fn a_duplicate_tenant_id_is_a_409() {
        let app = TestApp::start("").await;
        app.create_tenant("acme", "pro").await;
        let response = app
            .admin(Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": "acme", "name": "Other", "plan": "basic"}))
            .send()
            .await
            .unwrap();
        expect_problem_kind(response, StatusCode::CONFLICT, "conflict").await;
        // The first tenant is unchanged.
        let tenant = app
            .admin(Method::GET, "/v1/admin/tenants/acme")
            .send()
            .await
            .unwrap();
        let tenant = expect_json(tenant, StatusCode::OK).await;
        assert_eq!(tenant["plan"], "pro");
    }
}

on_both_stores! {
    async fn an_invalid_tenant_id_is_a_422_naming_id() {
        let app = TestApp::start("").await;
        for id in ["Bad Id!", "", "-leading", &"a".repeat(65)] {
            let response = app
                .admin(Method::POST, "/v1/admin/tenants")
                .json(&json!({"id": id, "name": "X", "plan": "pro"}))
                .send()
                .await
                .unwrap();
            expect_field_error(response, "id").await;
        }
        let response = app
            .admin(Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": "acme", "name": " ", "plan": "pro"}))
            .send()
            .await
            .unwrap();
        expect_field_error(response, "name").await;
        let response = app
            .admin(Method::POST, "/v1/admin/tenants")
            .json(&json!({"id": "acme", "name": "Acme", "plan": "pro", "tier": "gold"}))
            .send()
            .await
            .unwrap();
        expect_field_error(response, "tier").await;
    }
}

on_both_stores! {
    async fn changing_a_tenants_plan_moves_its_next_sends_to_the_new_lane() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "basic").await;
        let before = expect_json(app.send(&key, &email()).await, StatusCode::ACCEPTED).await;
        assert_eq!(before["lane"], "slow");

        let tenant = app.patch_tenant("acme", json!({"plan": "pro"})).await;
        assert_eq!(tenant["plan"], "pro");
        assert_eq!(tenant["status"], "active", "a plan change keeps the status");
        let after = expect_json(app.send(&key, &email()).await, StatusCode::ACCEPTED).await;
        assert_eq!(after["lane"], "fast");

        let unknown = app
            .admin(Method::PATCH, "/v1/admin/tenants/acme")
            .json(&json!({"plan": "platinum"}))
            .send()
            .await
            .unwrap();
        expect_field_error(unknown, "plan").await;
        let missing = app
            .admin(Method::PATCH, "/v1/admin/tenants/nobody")
            .json(&json!({"status": "paused"}))
            .send()
            .await
            .unwrap();
        expect_problem(missing, StatusCode::NOT_FOUND).await;
    }
}

on_both_stores! {
    async fn a_deleted_tenant_is_gone_and_its_keys_stop_working() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::ACCEPTED
        );
        // Its message is still queued, so deleting is refused for now.
        let refused = app
            .admin(Method::DELETE, "/v1/admin/tenants/acme")
            .send()
            .await
            .unwrap();
        expect_problem(refused, StatusCode::CONFLICT).await;
        assert_eq!(
            app.send(&key, &email()).await.status(),
            StatusCode::ACCEPTED
        );

        // A scheduled message is undelivered too.
        let later = app.tenant_with_key("later", "pro").await;
        let send_at = crate::scheduled::rfc3339_in(chrono::Duration::hours(1));
        let scheduled = expect_json(
            app.send(&later, &with(email(), "send_at", serde_json::json!(send_at))).await,
            StatusCode::ACCEPTED,
        )
        .await;
        assert_eq!(scheduled["status"], "scheduled");
        let refused = app
            .admin(Method::DELETE, "/v1/admin/tenants/later")
            .send()
            .await
            .unwrap();
        expect_problem(refused, StatusCode::CONFLICT).await;

        let quiet = app.tenant_with_key("quiet", "pro").await;
        let deleted = app
            .admin(Method::DELETE, "/v1/admin/tenants/quiet")
            .send()
            .await
            .unwrap();
        assert_eq!(deleted.status(), StatusCode::NO_CONTENT);

        expect_problem(app.send(&quiet, &email()).await, StatusCode::UNAUTHORIZED).await;
        let tenant = app
            .admin(Method::GET, "/v1/admin/tenants/quiet")
            .send()
            .await
            .unwrap();
        expect_problem(tenant, StatusCode::NOT_FOUND).await;
        let again = app
            .admin(Method::DELETE, "/v1/admin/tenants/quiet")
            .send()
            .await
            .unwrap();
        expect_problem(again, StatusCode::NOT_FOUND).await;
        let list = app
            .admin(Method::GET, "/v1/admin/tenants")
            .send()
            .await
            .unwrap();
        let list = expect_json(list, StatusCode::OK).await;
        let ids: Vec<&str> = list["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["acme", "later"]);
    }
}

on_both_stores! {
    async fn a_tenant_shows_its_key_ids_but_never_the_secrets() {
        let app = TestApp::start("").await;
        app.create_tenant("acme", "pro").await;
        let (first_id, first_key) = app.issue_key("acme").await;
        let (second_id, second_key) = app.issue_key("acme").await;
        assert_ne!(first_key, second_key);
        let revoked = app
            .admin(
                Method::DELETE,
                &format!("/v1/admin/tenants/acme/keys/{second_id}"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(revoked.status(), StatusCode::NO_CONTENT);

        let response = app
            .admin(Method::GET, "/v1/admin/tenants/acme")
            .send()
            .await
            .unwrap();
        let text = response.text().await.unwrap();
        let detail: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(detail["id"], "acme");
        assert_eq!(detail["plan"], "pro");
        assert_eq!(detail["status"], "active");
        let keys = detail["keys"].as_array().expect("keys");
        let ids: Vec<&str> = keys.iter().filter_map(|k| k["id"].as_str()).collect();
        assert_eq!(ids.len(), 2, "{detail}");
        assert!(
            ids.contains(&first_id.as_str()) && ids.contains(&second_id.as_str()),
            "{detail}"
        );
        let second = keys.iter().find(|k| k["id"] == second_id.as_str()).unwrap();
        assert!(second["revoked_at"].is_string(), "{detail}");
        let first = keys.iter().find(|k| k["id"] == first_id.as_str()).unwrap();
        assert!(first["revoked_at"].is_null(), "{detail}");
        for key in [&first_key, &second_key] {
            let secret = key.rsplit('_').next().unwrap();
            assert!(!text.contains(secret), "a secret is shown: {text}");
        }
    }
}

on_both_stores! {
    async fn a_key_for_an_unknown_tenant_is_not_found() {
        let app = TestApp::start("").await;
        let response = app
            .admin(Method::POST, "/v1/admin/tenants/nobody/keys")
            .send()
            .await
            .unwrap();
        expect_problem(response, StatusCode::NOT_FOUND).await;
    }
}

#[tokio::test]
async fn a_path_segment_that_is_not_utf8_answers_a_problem_not_plain_text() {
    let app = TestApp::start("").await;
    let key = app.tenant_with_key("acme", "pro").await;
    for path in ["/v1/admin/plans/%FF", "/v1/admin/tenants/%C3%28"] {
        let response = app.admin(Method::GET, path).send().await.unwrap();
        let (_, body) = expect_problem(response, StatusCode::BAD_REQUEST).await;
        assert!(
            body["detail"].as_str().unwrap().contains("UTF-8"),
            "{path}: {body}"
        );
    }
    let response = app
        .tenant(&key, Method::GET, "/v1/messages/%FF%FE")
        .send()
        .await
        .unwrap();
    expect_problem(response, StatusCode::BAD_REQUEST).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_with_an_empty_body_is_refused_and_an_empty_object_redrives_everything() {
    let app = TestApp::start("").await;
    let response = app
        .admin(Method::POST, "/v1/admin/dlq/redrive")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    let (_, problem) = expect_problem(response, StatusCode::BAD_REQUEST).await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("name what to redrive"),
        "{problem}"
    );
    let redriven = expect_json(
        app.admin(Method::POST, "/v1/admin/dlq/redrive")
            .json(&json!({}))
            .send()
            .await
            .unwrap(),
        StatusCode::OK,
    )
    .await;
    assert_eq!(redriven["redriven"], 0);
}
