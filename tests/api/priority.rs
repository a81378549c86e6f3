//! Priority and fairness at depth, end to end: real HTTP in, the embedded
//! queue (and the lanes in PostgreSQL), the lane consumer and the SMS gate,
//! wiremock as the provider. The
//! gate is set low so a backlog builds; each test reads the order in which
//! the provider saw the messages, not wall-clock timings.

use std::time::{Duration, Instant};

use serde_json::json;
use wiremock::MockServer;

use crate::delivery::{delivery_settings, mock_sms_ok, sms_requests};
use crate::support::{TestApp, on_embedded_and_postgres_lanes};

/// A plan whose own limits stay out of the way: the gate is what paces.
const OPEN_PLAN: &str = "[plans.open]\nlane = \"fast\"\nrate_per_second = 1000.0\nburst = 1000\ndaily_quota = 1000000\nmax_in_flight = 8\n";

/// Delivery settings with the SMS gate at `rate` per second, burst 1.
fn gated_settings(sms_base: &str, rate: f64) -> String {
    delivery_settings(sms_base, "http://127.0.0.1:9", OPEN_PLAN).replacen(
        "rate_per_second = 1000.0\nburst = 100",
        &format!("rate_per_second = {rate}\nburst = 1"),
        1,
    )
}

/// The `Body` text of each SMS the provider received, in arrival order.
async fn bodies(server: &MockServer) -> Vec<String> {
    server
        .received_requests()
        .await
        .unwrap_or_default()
        .iter()
        .map(|request| {
            form_urlencoded::parse(&request.body)
                .find(|(name, _)| name == "Body")
                .map(|(_, value)| value.into_owned())
                .unwrap_or_default()
        })
        .collect()
}

/// Waits until the provider has seen an SMS whose text is `body`; returns
/// every text it saw, in order.
async fn wait_for_body(server: &MockServer, body: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let order = bodies(server).await;
        if order.iter().any(|seen| seen == body) {
            return order;
        }
        assert!(
            Instant::now() < deadline,
            "{body:?} never reached the provider: {order:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn wait_for_requests(server: &MockServer, count: usize, within: Duration) {
    let deadline = Instant::now() + within;
    while sms_requests(server).await < count {
        assert!(
            Instant::now() < deadline,
            "the provider saw {} of {count} requests in {within:?}",
            sms_requests(server).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The provider call at which the SMS whose text is `body` arrived.
fn call_of(order: &[String], body: &str) -> usize {
    order
        .iter()
        .position(|seen| seen == body)
        .unwrap_or_else(|| panic!("{body:?} never reached the provider: {order:?}"))
}

fn sms(text: &str, priority: &str) -> serde_json::Value {
    json!({"channel": "sms", "to": "+15551234567", "text": text, "priority": priority})
}

on_embedded_and_postgres_lanes! {
    async fn a_high_sms_behind_its_own_tenants_low_backlog_reaches_the_provider_next() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM1").await;
        let app = TestApp::start(&gated_settings(&sms_api.uri(), 10.0)).await;
        let key = app.tenant_with_key("acme", "open").await;
        for n in 0..80 {
            app.send_accepted(&key, &sms(&format!("low {n}"), "low"))
                .await;
        }
        wait_for_requests(&sms_api, 3, Duration::from_secs(10)).await;

        let mut seen_at_accept = Vec::new();
        for n in 0..3 {
            app.send_accepted(&key, &sms(&format!("high {n}"), "high"))
                .await;
            seen_at_accept.push(sms_requests(&sms_api).await);
        }
        let order = wait_for_body(&sms_api, "high 2").await;
        for (n, seen) in seen_at_accept.iter().enumerate() {
            let at = call_of(&order, &format!("high {n}"));
            // The provider may already have been called for the token granted
            // just before the high arrived, and the tenant is at its cap, so a
            // high waits for one of its own lows to finish; after that the
            // highs come first, one after the other.
            assert!(
                at <= seen + 4 + n,
                "high {n} was call {at}, {seen} calls had been made at its 202: {order:?}"
            );
        }
        let lows_between = order
            .iter()
            .skip_while(|body| !body.starts_with("high"))
            .take_while(|body| *body != "high 2")
            .filter(|body| body.starts_with("low"))
            .count();
        assert!(lows_between <= 1, "{lows_between} lows between the highs");
    }
}

on_embedded_and_postgres_lanes! {
    async fn low_messages_still_progress_under_a_continuous_flood_of_high_ones() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM1").await;
        let app = TestApp::start(&gated_settings(&sms_api.uri(), 20.0)).await;
        let flood_key = app.tenant_with_key("flood", "open").await;
        let bulk_key = app.tenant_with_key("bulk", "open").await;
        // Highs arrive at twice the gate's rate for the whole test.
        let flooder = {
            let app_url = app.url("/v1/messages");
            let client = app.client.clone();
            tokio::spawn(async move {
                for n in 0..240 {
                    let response = client
                        .post(&app_url)
                        .bearer_auth(&flood_key)
                        .json(&sms(&format!("high {n}"), "high"))
                        .send()
                        .await
                        .expect("send high");
                    assert_eq!(response.status(), 202);
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        for n in 0..30 {
            app.send_accepted(&bulk_key, &sms(&format!("low {n}"), "low"))
                .await;
        }
        let from = sms_requests(&sms_api).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let order = bodies(&sms_api).await;
        assert!(!flooder.is_finished(), "the flood must outlast the check");
        flooder.abort();
        let window = &order[from..];
        let lows = window.iter().filter(|body| body.starts_with("low")).count();
        let highs = window
            .iter()
            .filter(|body| body.starts_with("high"))
            .count();
        // The default share is 0.1: about one call in eleven is owed to lows
        // while highs flood; strict priority would give them none.
        assert!(
            lows * 20 >= highs + lows && lows * 4 <= highs + lows,
            "{lows} lows and {highs} highs in {} calls",
            window.len()
        );
    }
}

on_embedded_and_postgres_lanes! {
    async fn a_quiet_tenant_beside_a_noisy_tenants_backlog_is_served_within_a_turn() {
        let sms_api = MockServer::start().await;
        mock_sms_ok(&sms_api, "SM1").await;
        let app = TestApp::start(&gated_settings(&sms_api.uri(), 20.0)).await;
        let noisy = app.tenant_with_key("noisy", "open").await;
        let quiet = app.tenant_with_key("quiet", "open").await;
        for n in 0..150 {
            app.send_accepted(&noisy, &sms(&format!("noisy {n}"), "normal"))
                .await;
        }
        wait_for_requests(&sms_api, 3, Duration::from_secs(10)).await;
        let mut seen_at_accept = Vec::new();
        for n in 0..5 {
            app.send_accepted(&quiet, &sms(&format!("quiet {n}"), "normal"))
                .await;
            seen_at_accept.push(sms_requests(&sms_api).await);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let order = wait_for_body(&sms_api, "quiet 4").await;
        for (n, seen) in seen_at_accept.iter().enumerate() {
            let at = call_of(&order, &format!("quiet {n}"));
            // Same priority: the quiet tenant waits for a place to free in the
            // consumer (the noisy tenant's messages hold them), one receive, and
            // one turn of the noisy tenant at the gate; not for the noisy
            // tenant's dozens of buffered and parked messages.
            assert!(
                at <= seen + 5,
                "quiet {n} was call {at}, {seen} calls had been made at its 202"
            );
        }
    }
}
