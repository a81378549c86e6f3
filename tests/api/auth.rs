//! Authentication: tenant keys on `/v1/messages*`, the admin token on
//! `/v1/admin/*`, and neither standing in for the other.

use reqwest::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode};

use crate::support::*;

on_both_stores! {
    async fn a_send_without_authorization_is_401_with_a_bearer_challenge() {
        let app = TestApp::start("").await;
        let response = app
            .client
            .post(app.url("/v1/messages"))
            .json(&email())
            .send()
            .await
            .unwrap();
        let (headers, _) =
            expect_problem_kind(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
        assert_eq!(header(&headers, WWW_AUTHENTICATE.as_str()), Some("Bearer"));
    }
}

on_both_stores! {
    async fn a_malformed_authorization_header_is_401() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let malformed = [
            format!("Basic {key}"),
            key.clone(),
            "Bearer".to_owned(),
            "Bearer ".to_owned(),
            "Bearer    ".to_owned(),
        ];
        for value in malformed {
            let response = app
                .client
                .post(app.url("/v1/messages"))
                .header(AUTHORIZATION, &value)
                .json(&email())
                .send()
                .await
                .unwrap();
            let (headers, _) = expect_problem(response, StatusCode::UNAUTHORIZED).await;
            assert!(headers.contains_key(WWW_AUTHENTICATE), "{value:?}");
        }
        // The same key, well-formed, is accepted, so the refusals were about form.
        let ok = app
            .client
            .post(app.url("/v1/messages"))
            .header(AUTHORIZATION, format!("bearer {key}"))
            .json(&email())
            .send()
            .await
            .unwrap();
        assert_eq!(ok.status(), StatusCode::ACCEPTED);
    }
}

on_both_stores! {
    async fn an_unknown_or_tampered_key_is_401() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        let mut tampered = key.clone();
        let last = tampered.pop().unwrap();
        tampered.push(if last == '0' { '1' } else { '0' });
        let key_id = key.split('_').nth(1).unwrap();
        for bad in [
            "fl_0000000000000000_00".to_owned(),
            tampered,
            format!("fl_{key_id}"),
            "not-a-key".to_owned(),
        ] {
            let response = app.send(&bad, &email()).await;
            expect_problem(response, StatusCode::UNAUTHORIZED).await;
            let response = app.get_message(&bad, "anything").await;
            expect_problem(response, StatusCode::UNAUTHORIZED).await;
        }
    }
}

on_both_stores! {
    async fn a_revoked_key_stops_working_and_other_keys_do_not() {
        let app = TestApp::start("").await;
        let (first_id, first) = {
            app.create_tenant("acme", "pro").await;
            app.issue_key("acme").await
        };
        let (_, second) = app.issue_key("acme").await;
        assert_eq!(
            app.send(&first, &email()).await.status(),
            StatusCode::ACCEPTED
        );

        let revoked = app
            .admin(
                Method::DELETE,
                &format!("/v1/admin/tenants/acme/keys/{first_id}"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(revoked.status(), StatusCode::NO_CONTENT);

        expect_problem(app.send(&first, &email()).await, StatusCode::UNAUTHORIZED).await;
        assert_eq!(
            app.send(&second, &email()).await.status(),
            StatusCode::ACCEPTED
        );

        // Revoking again finds no active key.
        let again = app
            .admin(
                Method::DELETE,
                &format!("/v1/admin/tenants/acme/keys/{first_id}"),
            )
            .send()
            .await
            .unwrap();
        expect_problem(again, StatusCode::NOT_FOUND).await;
    }
}

on_both_stores! {
    async fn a_tenant_key_on_an_admin_route_is_403() {
        let app = TestApp::start("").await;
        let key = app.tenant_with_key("acme", "pro").await;
        for (method, path) in [
            (Method::GET, "/v1/admin/plans"),
            (Method::GET, "/v1/admin/tenants"),
            (Method::GET, "/v1/admin/tenants/acme"),
            (Method::POST, "/v1/admin/tenants/acme/keys"),
        ] {
            let response = app.tenant(&key, method, path).send().await.unwrap();
            expect_problem_kind(response, StatusCode::FORBIDDEN, "forbidden").await;
        }
    }
}

on_both_stores! {
    async fn the_admin_token_on_a_tenant_route_is_401() {
        let app = TestApp::start("").await;
        app.create_tenant("acme", "pro").await;
        let response = app.send(ADMIN_TOKEN, &email()).await;
        expect_problem(response, StatusCode::UNAUTHORIZED).await;
        let response = app.get_message(ADMIN_TOKEN, "anything").await;
        expect_problem(response, StatusCode::UNAUTHORIZED).await;
    }
}

on_both_stores! {
    async fn an_admin_route_without_or_with_a_wrong_token_is_401() {
        let app = TestApp::start("").await;
        let missing = app
            .client
            .get(app.url("/v1/admin/plans"))
            .send()
            .await
            .unwrap();
        let (headers, _) = expect_problem(missing, StatusCode::UNAUTHORIZED).await;
        assert_eq!(header(&headers, WWW_AUTHENTICATE.as_str()), Some("Bearer"));

        let wrong = app
            .client
            .get(app.url("/v1/admin/plans"))
            .bearer_auth("test-admin-token-0123456780")
            .send()
            .await
            .unwrap();
        expect_problem(wrong, StatusCode::UNAUTHORIZED).await;

        let create = app
            .client
            .post(app.url("/v1/admin/tenants"))
            .bearer_auth("wrong")
            .json(&serde_json::json!({"id": "x", "name": "X", "plan": "pro"}))
            .send()
            .await
            .unwrap();
        expect_problem(create, StatusCode::UNAUTHORIZED).await;
        // Nothing was created by the refused call.
        let tenant = app
            .admin(Method::GET, "/v1/admin/tenants/x")
            .send()
            .await
            .unwrap();
        expect_problem(tenant, StatusCode::NOT_FOUND).await;
    }
}
