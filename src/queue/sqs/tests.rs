//! Tests against a local SQS-compatible server (moto) at
//! `FAIRLANE_TEST_SQS_URL`, or one `crate::test_servers` starts.

use super::batch::{chunks, entry_results};
use super::lanes::{MAX_RETENTION_SECS, queue_url};
use super::*;
use crate::config::Settings;
use crate::model::{Channel, Priority};
use crate::queue::priority::CLASSES;
use aws_sdk_sqs::config::Credentials;
use aws_sdk_sqs::config::retry::RetryConfig;
use aws_sdk_sqs::types::BatchResultErrorEntry;

/// The local SQS-compatible server (moto) the tests run against; a test
/// without one fails with a clear message rather than passing unrun.
fn server_url() -> Option<String> {
    Some(required_server_url())
}

/// The local server for tests that must not be skipped: a clear failure
/// without one.
fn required_server_url() -> String {
    crate::test_servers::sqs_url()
}

/// A client for a local server: static credentials, one attempt per
/// call so that unimplemented operations fail fast.
fn test_client(url: &str) -> Client {
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .endpoint_url(url)
        .retry_config(RetryConfig::standard().with_max_attempts(1))
        .build();
    Client::from_conf(config)
}

fn settings(url: &str, prefix: &str, create: bool, max_receive_count: u32) -> Settings {
    settings_with(url, prefix, create, max_receive_count, 30)
}

fn settings_with(
    url: &str,
    prefix: &str,
    create: bool,
    max_receive_count: u32,
    visibility_timeout_secs: u64,
) -> Settings {
    Settings::from_toml_overlay(&format!(
        "[queue.sqs]\nendpoint_url = \"{url}\"\nregion = \"us-east-1\"\n\
         queue_prefix = \"{prefix}\"\ncreate_queues = {create}\n\
         [lanes.fast]\nvisibility_timeout_secs = {visibility_timeout_secs}\nmax_receive_count = {max_receive_count}\n"
    ))
    .unwrap()
}

fn unique_prefix() -> String {
    format!("ft-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])
}

struct Fixture {
    queue: SqsQueue,
    /// A plain client for looking at the queues from outside.
    client: Client,
    prefix: String,
}

impl Fixture {
    async fn url(&self, name: &str) -> String {
        queue_url(&self.client, &format!("{}-{name}", self.prefix))
            .await
            .unwrap()
    }

    /// Messages visible now in queue `{prefix}-{name}`.
    async fn visible(&self, name: &str) -> u64 {
        let url = self.url(name).await;
        let attributes = queue_attributes(
            &self.client,
            &url,
            &[QueueAttributeName::ApproximateNumberOfMessages],
        )
        .await
        .unwrap();
        count(&attributes, QueueAttributeName::ApproximateNumberOfMessages)
    }

    /// Waits until the fast lane's stashes hold `expected` (per class).
    async fn stashed(&self, expected: [usize; CLASSES]) {
        let receiver = self.queue.receiver(Lane::Fast);
        let deadline = Instant::now() + Duration::from_secs(10);
        while receiver.stashed() != expected {
            assert!(
                Instant::now() < deadline,
                "stashes hold {:?}, expected {expected:?}",
                receiver.stashed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A queue with fresh lane queues, or `None` without a server.
async fn fixture(max_receive_count: u32) -> Option<Fixture> {
    Some(fixture_at(&server_url()?, max_receive_count, 30).await)
}

/// A queue with fresh lane queues whose fast lane has the given visibility
/// timeout; fails the test without a server.
async fn required_fixture(visibility_timeout_secs: u64) -> Fixture {
    fixture_at(&required_server_url(), 5, visibility_timeout_secs).await
}

async fn fixture_at(url: &str, max_receive_count: u32, visibility_timeout_secs: u64) -> Fixture {
    let url = url.to_owned();
    let prefix = unique_prefix();
    let settings = settings_with(
        &url,
        &prefix,
        true,
        max_receive_count,
        visibility_timeout_secs,
    );
    fixture_from(&url, prefix, &settings).await
}

/// A queue on `url` with `settings` (queues named by `prefix`).
async fn fixture_from(url: &str, prefix: String, settings: &Settings) -> Fixture {
    let mut queue = SqsQueue::connect_with_client(
        test_client(url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .unwrap();
    // Fresh statistics on every call (caching has a test of its own).
    queue.stats_interval = Duration::ZERO;
    Fixture {
        queue,
        client: test_client(url),
        prefix,
    }
}

/// A high-priority SMS of `tenant`.
fn message(tenant: &str, n: usize) -> OutboundMessage {
    message_of(tenant, n, Priority::High)
}

fn message_of(tenant: &str, n: usize, priority: Priority) -> OutboundMessage {
    OutboundMessage {
        message_id: format!("{tenant}-{n}"),
        tenant_id: tenant.to_owned(),
        channel: Channel::Sms,
        priority,
        body: format!("{{\"n\":{n}}}"),
        delay: Duration::ZERO,
    }
}

async fn send(queue: &SqsQueue, messages: Vec<OutboundMessage>) {
    let results = queue.send_batch(Lane::Fast, messages).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// Receives from the fast lane until `n` messages arrived (or a few
/// empty polls).
async fn receive_n(queue: &SqsQueue, n: usize) -> Vec<ReceivedMessage> {
    let mut got = Vec::new();
    for _ in 0..n.div_ceil(10) + 5 {
        if got.len() >= n {
            break;
        }
        got.extend(
            queue
                .receive(Lane::Fast, n - got.len(), Duration::ZERO)
                .await
                .unwrap(),
        );
    }
    got
}

fn ids<'a>(messages: impl IntoIterator<Item = &'a ReceivedMessage>) -> Vec<String> {
    let mut ids: Vec<String> = messages.into_iter().map(|m| m.message_id.clone()).collect();
    ids.sort();
    ids
}

#[tokio::test]
async fn created_queues_get_the_redrive_policy_and_visibility_timeout_also_when_they_existed() {
    let Some(url) = server_url() else { return };
    let prefix = unique_prefix();
    let first = settings(&url, &prefix, true, 4);
    SqsQueue::connect_with_client(test_client(&url), &first.queue.sqs, first.lanes.clone())
        .await
        .unwrap();
    // Connecting again with other lane settings updates the queues.
    let mut second = settings(&url, &prefix, true, 7);
    second.lanes.fast.visibility_timeout_secs = 45;
    SqsQueue::connect_with_client(test_client(&url), &second.queue.sqs, second.lanes.clone())
        .await
        .unwrap();

    let client = test_client(&url);
    let dlq_url = queue_url(&client, &format!("{prefix}-fast-dlq"))
        .await
        .unwrap();
    let dlq = queue_attributes(&client, &dlq_url, &[QueueAttributeName::All])
        .await
        .unwrap();
    assert_eq!(
        dlq[&QueueAttributeName::MessageRetentionPeriod],
        MAX_RETENTION_SECS.to_string()
    );
    // The three class queues share the lane's DLQ.
    for name in ["fast-high", "fast", "fast-low"] {
        let class_url = queue_url(&client, &format!("{prefix}-{name}"))
            .await
            .unwrap();
        let class = queue_attributes(&client, &class_url, &[QueueAttributeName::All])
            .await
            .unwrap();
        assert_eq!(
            class[&QueueAttributeName::VisibilityTimeout],
            "45",
            "{name}"
        );
        let policy: serde_json::Value =
            serde_json::from_str(&class[&QueueAttributeName::RedrivePolicy]).unwrap();
        assert_eq!(
            policy["deadLetterTargetArn"],
            dlq[&QueueAttributeName::QueueArn].as_str(),
            "{name}"
        );
        assert_eq!(
            policy["maxReceiveCount"].to_string().trim_matches('"'),
            "10",
            "max_receive_count 7 + the redrive margin"
        );
        assert_eq!(
            class[&QueueAttributeName::MessageRetentionPeriod],
            MAX_RETENTION_SECS.to_string(),
            "{name}"
        );
    }
    // The slow lane has its own.
    for name in ["slow-high", "slow", "slow-low", "slow-dlq"] {
        queue_url(&client, &format!("{prefix}-{name}"))
            .await
            .unwrap();
    }
}

#[tokio::test]
async fn missing_queues_are_an_error_naming_the_queue_when_creation_is_off() {
    let Some(url) = server_url() else { return };
    let prefix = unique_prefix();
    let settings = settings(&url, &prefix, false, 5);
    let err = SqsQueue::connect_with_client(
        test_client(&url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .err()
    .expect("connect must fail without queues");
    let text = format!("{err:#}");
    assert!(
        text.contains(&format!("SQS queue {prefix}-fast-high does not exist"))
            && text.contains("queue.sqs.create_queues = true"),
        "{text}"
    );
}

#[tokio::test]
async fn a_deployment_from_before_priority_classes_is_told_which_class_queue_is_missing() {
    let url = required_server_url();
    let prefix = unique_prefix();
    let client = test_client(&url);
    // The queues of a deployment with one queue per lane.
    for name in ["fast", "fast-dlq", "slow", "slow-dlq"] {
        client
            .create_queue()
            .queue_name(format!("{prefix}-{name}"))
            .send()
            .await
            .unwrap();
    }
    let settings = settings(&url, &prefix, false, 5);
    let err = SqsQueue::connect_with_client(
        test_client(&url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .err()
    .expect("connect must fail without the class queues");
    let text = format!("{err:#}");
    assert!(
        text.contains(&format!("SQS queue {prefix}-fast-high does not exist")),
        "{text}"
    );
    client
        .create_queue()
        .queue_name(format!("{prefix}-fast-high"))
        .send()
        .await
        .unwrap();
    let err = SqsQueue::connect_with_client(
        test_client(&url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .err()
    .expect("connect must fail without the low queue");
    let text = format!("{err:#}");
    assert!(
        text.contains(&format!("SQS queue {prefix}-fast-low does not exist")),
        "{text}"
    );
}

#[tokio::test]
async fn existing_queues_are_found_when_creation_is_off() {
    let Some(f) = fixture(5).await else { return };
    let url = server_url().unwrap();
    let settings = settings(&url, &f.prefix, false, 5);
    let queue = SqsQueue::connect_with_client(
        test_client(&url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .unwrap();
    assert!(queue.ping().await);
}

#[tokio::test]
async fn connect_uses_the_standard_credential_chain_and_the_endpoint_override() {
    // The chain's variables are set for a run of this test in a child process.
    let name = "connect_uses_the_standard_credential_chain_and_the_endpoint_override";
    if !crate::test_servers::in_child_with_aws_env(module_path!(), name) {
        return;
    }
    let Some(url) = server_url() else { return };
    let settings = settings(&url, &unique_prefix(), true, 5);
    let queue = SqsQueue::connect(&settings.queue.sqs, settings.lanes.clone())
        .await
        .unwrap();
    assert!(queue.ping().await);
}

#[tokio::test]
async fn a_batch_of_fifteen_arrives_with_its_attributes_and_the_tenant_as_group_id() {
    let Some(f) = fixture(5).await else { return };
    let messages: Vec<OutboundMessage> = (0..15)
        .map(|n| message(if n % 2 == 0 { "acme" } else { "globex" }, n))
        .collect();
    let before = f.queue.api_calls();
    let results = f
        .queue
        .send_batch(Lane::Fast, messages.clone())
        .await
        .unwrap();
    assert_eq!(results, vec![Ok(()); 15]);
    assert_eq!(
        f.queue.api_calls() - before,
        2,
        "15 messages take two calls"
    );

    // High-priority messages (see `message`) go to the high queue.
    let url = f.url("fast-high").await;
    let mut seen = HashMap::new();
    for _ in 0..5 {
        let output = f
            .client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
            .message_attribute_names("All")
            .send()
            .await
            .unwrap();
        for raw in output.messages() {
            let attribute = |name: &str| {
                let value = &raw.message_attributes().unwrap()[name];
                assert_eq!(value.data_type(), "String");
                value.string_value().unwrap().to_owned()
            };
            let group =
                raw.attributes().unwrap()[&MessageSystemAttributeName::MessageGroupId].clone();
            let id = attribute("message_id");
            assert_eq!(group, attribute("tenant"), "{id}");
            assert_eq!(attribute("channel"), "sms");
            assert_eq!(attribute("priority"), "high");
            seen.insert(id, (group, raw.body().unwrap().to_owned()));
        }
    }
    assert_eq!(seen.len(), 15);
    for sent in &messages {
        assert_eq!(
            seen[&sent.message_id],
            (sent.tenant_id.clone(), sent.body.clone())
        );
    }
}

#[tokio::test]
async fn a_received_message_stays_invisible_until_its_visibility_is_set_to_zero() {
    let Some(f) = fixture(5).await else { return };
    let sent_at = crate::model::now_ms();
    send(&f.queue, vec![message("acme", 1)]).await;

    let first = f
        .queue
        .receive(Lane::Fast, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    let got = &first[0];
    assert_eq!(
        (
            got.message_id.as_str(),
            got.tenant_id.as_str(),
            got.channel,
            got.priority,
            got.body.as_str(),
            got.receive_count
        ),
        (
            "acme-1",
            "acme",
            Channel::Sms,
            Priority::High,
            "{\"n\":1}",
            1
        )
    );
    assert!((got.enqueued_at_ms - sent_at).abs() < 5_000, "{got:?}");
    assert!(
        f.queue
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );

    let changed = f
        .queue
        .change_visibility_batch(Lane::Fast, &[(got.receipt.clone(), Duration::ZERO)])
        .await
        .unwrap();
    assert_eq!(changed, vec![Ok(())]);
    let again = f
        .queue
        .receive(Lane::Fast, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].receive_count, 2);
    assert_eq!(again[0].enqueued_at_ms, got.enqueued_at_ms);
}

#[tokio::test]
async fn a_bogus_receipt_fails_alone_in_a_delete_batch() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, (0..3).map(|n| message("acme", n)).collect()).await;
    let got = receive_n(&f.queue, 3).await;
    assert_eq!(got.len(), 3);
    let receipts = vec![
        got[0].receipt.clone(),
        "not-a-receipt".to_owned(),
        got[1].receipt.clone(),
        got[2].receipt.clone(),
    ];
    let results = f.queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    assert!(results[0].is_ok() && results[2].is_ok() && results[3].is_ok());
    assert!(results[1].is_err(), "{results:?}");
    assert_eq!(f.queue.deleted_total(Lane::Fast), 3);
    assert_eq!(f.queue.deleted_total(Lane::Slow), 0);
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 0));
}

/// SQS's redrive policy is the backstop: it moves a message three
/// receives after `max_receive_count` (the consumer dead-letters one
/// received more than `max_receive_count` times itself, with its status).
#[tokio::test]
async fn a_message_received_past_the_redrive_count_moves_to_the_dlq() {
    let Some(f) = fixture(2).await else { return };
    send(&f.queue, vec![message("acme", 1)]).await;
    let redrive_at = lanes::redrive_receive_count(2);
    assert_eq!(redrive_at, 5);
    for expected in 1..=redrive_at {
        let got = f
            .queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(got[0].receive_count, expected);
        f.queue
            .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
            .await
            .unwrap();
    }
    assert!(
        f.queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
    let dead = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "acme-1");
    assert_eq!(dead[0].receive_count, redrive_at);
}

#[tokio::test]
async fn a_message_deferred_three_times_max_receive_count_never_reaches_the_dlq() {
    let Some(f) = fixture(2).await else { return };
    send(&f.queue, vec![message("acme", 1)]).await;
    let mut enqueued_at = None;
    for _ in 0..6 {
        let got = f
            .queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap();
        assert_eq!(got.len(), 1, "a deferred message must come back");
        assert_eq!(got[0].receive_count, 1);
        assert_eq!(got[0].message_id, "acme-1");
        assert_eq!(
            *enqueued_at.get_or_insert(got[0].enqueued_at_ms),
            got[0].enqueued_at_ms
        );
        f.queue
            .defer(Lane::Fast, &got[0], Duration::ZERO)
            .await
            .unwrap();
    }
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (1, 0, 0));
    assert_eq!(f.queue.deleted_total(Lane::Fast), 0);
}

#[tokio::test]
async fn a_deferred_message_is_delayed() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, vec![message("acme", 1)]).await;
    let got = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    f.queue
        .defer(Lane::Fast, &got[0], Duration::from_millis(1500))
        .await
        .unwrap();
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.delayed, stats.in_flight), (1, 1, 0));
    assert!(
        f.queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let back = f
        .queue
        .receive(Lane::Fast, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(back.len(), 1);
}

#[tokio::test]
async fn dead_letter_moves_a_received_message_to_the_dlq() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, vec![message("acme", 1)]).await;
    let got = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    f.queue.dead_letter(Lane::Fast, &got[0]).await.unwrap();
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
    let dead = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].receive_count, 1);
    assert_eq!(dead[0].enqueued_at_ms, got[0].enqueued_at_ms);
}

#[tokio::test]
async fn listing_dead_letters_leaves_them_in_the_dlq() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, vec![message("acme", 1), message("globex", 2)]).await;
    for got in receive_n(&f.queue, 2).await {
        f.queue.dead_letter(Lane::Fast, &got).await.unwrap();
    }
    let first = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    let listed: Vec<(&str, &str, Channel, Priority, &str)> = first
        .iter()
        .map(|d| {
            (
                d.message_id.as_str(),
                d.tenant_id.as_str(),
                d.channel,
                d.priority,
                d.body.as_str(),
            )
        })
        .collect();
    let mut sorted = listed.clone();
    sorted.sort_by_key(|entry| entry.0);
    assert_eq!(
        sorted,
        vec![
            ("acme-1", "acme", Channel::Sms, Priority::High, "{\"n\":1}"),
            (
                "globex-2",
                "globex",
                Channel::Sms,
                Priority::High,
                "{\"n\":2}"
            ),
        ]
    );
    // Visible again at once: a second listing sees them all.
    let second = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(second.len(), 2);
    assert_eq!(
        f.queue
            .list_dead_letters(Lane::Fast, 1)
            .await
            .unwrap()
            .len(),
        1
    );
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(stats.dlq_depth, 2);
    assert!(
        f.queue
            .list_dead_letters(Lane::Slow, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn redrive_by_tenant_and_by_id_moves_only_matching_messages() {
    let Some(f) = fixture(5).await else { return };
    send(
        &f.queue,
        vec![message("a", 1), message("a", 2), message("b", 1)],
    )
    .await;
    for got in receive_n(&f.queue, 3).await {
        f.queue.dead_letter(Lane::Fast, &got).await.unwrap();
    }
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap().dlq_depth, 3);

    let none = RedriveFilter {
        tenant_id: None,
        message_ids: Some(vec![]),
    };
    assert!(f.queue.redrive(Lane::Fast, &none).await.unwrap().is_empty());
    let by_id = RedriveFilter {
        tenant_id: None,
        message_ids: Some(vec!["a-2".into()]),
    };
    assert_eq!(
        f.queue.redrive(Lane::Fast, &by_id).await.unwrap(),
        vec!["a-2".to_owned()]
    );
    let by_tenant = RedriveFilter {
        tenant_id: Some("b".into()),
        message_ids: None,
    };
    assert_eq!(
        f.queue.redrive(Lane::Fast, &by_tenant).await.unwrap(),
        vec!["b-1".to_owned()]
    );

    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.dlq_depth), (2, 1));
    let back = receive_n(&f.queue, 2).await;
    assert_eq!(ids(&back), vec!["a-2", "b-1"]);
    assert!(back.iter().all(|m| m.receive_count == 1));
    let left = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].message_id, "a-1");
}

#[tokio::test]
async fn stats_are_read_from_sqs_once_per_interval() {
    let Some(mut f) = fixture(5).await else {
        return;
    };
    f.queue.stats_interval = Duration::from_secs(60);
    let before = f.queue.api_calls();
    let first = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(
        f.queue.api_calls() - before,
        4,
        "attributes of the three class queues and the DLQ"
    );
    send(&f.queue, vec![message("acme", 1)]).await;
    let calls = f.queue.api_calls();
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap(), first);
    assert_eq!(f.queue.api_calls(), calls, "served from the cache");
    // Each lane has its own entry.
    f.queue.stats(Lane::Slow).await.unwrap();
    assert_eq!(f.queue.api_calls() - calls, 4);
}

#[tokio::test]
async fn redriving_everything_falls_back_when_the_move_task_fails() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, (0..3).map(|n| message("acme", n)).collect()).await;
    let received = receive_n(&f.queue, 3).await;
    for got in &received {
        f.queue.dead_letter(Lane::Fast, got).await.unwrap();
    }
    // moto does not implement StartMessageMoveTask.
    let mut redriven = f
        .queue
        .redrive(Lane::Fast, &RedriveFilter::default())
        .await
        .unwrap();
    redriven.sort();
    assert_eq!(redriven, vec!["acme-0", "acme-1", "acme-2"]);
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.dlq_depth), (3, 0));
    let back = receive_n(&f.queue, 3).await;
    assert_eq!(ids(&back), ids(&received));
    // The first enqueue time survives the round trip.
    for message in &back {
        let original = received
            .iter()
            .find(|r| r.message_id == message.message_id)
            .unwrap();
        assert_eq!(message.enqueued_at_ms, original.enqueued_at_ms);
    }
    assert!(
        f.queue
            .redrive(Lane::Fast, &RedriveFilter::default())
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn stats_count_waiting_in_flight_delayed_and_dead_messages_over_the_class_queues() {
    let Some(f) = fixture(5).await else { return };
    send(&f.queue, vec![message("acme", 1), message("acme", 2)]).await;
    let got = receive_n(&f.queue, 2).await;
    assert_eq!(got.len(), 2);
    f.queue.dead_letter(Lane::Fast, &got[1]).await.unwrap();
    // Waiting in each class queue, one of them delayed.
    let mut delayed = message_of("acme", 5, Priority::Normal);
    delayed.delay = Duration::from_secs(60);
    send(
        &f.queue,
        vec![
            message("acme", 3),
            message_of("acme", 4, Priority::Low),
            delayed,
        ],
    )
    .await;
    assert_eq!(
        f.queue.stats(Lane::Fast).await.unwrap(),
        QueueStats {
            depth: 3,
            in_flight: 1,
            delayed: 1,
            oldest_age_secs: None,
            dlq_depth: 1,
            held: 0,
        }
    );
    assert_eq!(
        f.queue.stats(Lane::Slow).await.unwrap(),
        QueueStats::default()
    );
}

#[tokio::test]
async fn api_calls_counts_each_sqs_call() {
    let Some(f) = fixture(5).await else { return };
    assert!(f.queue.api_calls() > 0, "connect makes calls");
    let start = f.queue.api_calls();
    send(&f.queue, (0..10).map(|n| message("acme", n)).collect()).await;
    assert_eq!(f.queue.api_calls() - start, 1);
    // A receive with empty stashes polls each class queue once.
    let got = f
        .queue
        .receive(Lane::Fast, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(got.len(), 10);
    assert_eq!(f.queue.api_calls() - start, 4);
    let receipts: Vec<String> = got.iter().map(|m| m.receipt.clone()).collect();
    f.queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    assert_eq!(f.queue.api_calls() - start, 5);
    // A mixed batch is one call per class.
    send(
        &f.queue,
        vec![
            message("acme", 10),
            message_of("acme", 11, Priority::Low),
            message("acme", 12),
        ],
    )
    .await;
    assert_eq!(f.queue.api_calls() - start, 7);
    f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(f.queue.api_calls() - start, 11);
}

#[tokio::test]
async fn an_abandoned_receive_returns_what_it_received() {
    let Some(f) = fixture(5).await else { return };
    // The receive is dropped mid-poll, as on shutdown...
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        f.queue.receive(Lane::Fast, 10, Duration::from_secs(3)),
    )
    .await;
    assert!(abandoned.is_err());
    // ...and the poll still running on the server takes this message.
    send(&f.queue, vec![message("acme", 1)]).await;
    // Without the release it would stay hidden for 30 s.
    let got = f
        .queue
        .receive(Lane::Fast, 10, Duration::from_secs(8))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].message_id, "acme-1");
}

/// Deletes what a test received, keeping moto's queues shallow.
async fn delete_all(queue: &SqsQueue, messages: &[ReceivedMessage]) {
    let receipts: Vec<String> = messages.iter().map(|m| m.receipt.clone()).collect();
    let results = queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

#[tokio::test]
async fn a_high_sent_after_a_low_backlog_is_handed_out_first() {
    let f = required_fixture(30).await;
    send(
        &f.queue,
        (0..25)
            .map(|n| message_of("acme", n, Priority::Low))
            .collect(),
    )
    .await;
    let wait = Duration::from_secs(2);
    let first = f.queue.receive(Lane::Fast, 10, wait).await.unwrap();
    assert_eq!(first.len(), 10);
    assert!(first.iter().all(|m| m.priority == Priority::Low));
    delete_all(&f.queue, &first).await;
    // The receive left a long poll waiting on the high queue, and the low
    // queue refills its stash meanwhile.
    send(&f.queue, vec![message("acme", 99)]).await;
    f.stashed([1, 0, 10]).await;
    let next = f.queue.receive(Lane::Fast, 10, wait).await.unwrap();
    assert_eq!(next[0].message_id, "acme-99", "{:?}", ids(&next));
    assert_eq!(next[0].priority, Priority::High);
    assert!(next[0].receipt.starts_with("high:"), "{}", next[0].receipt);
    assert!(next[1..].iter().all(|m| m.priority == Priority::Low));
    delete_all(&f.queue, &next).await;
}

#[tokio::test]
async fn lows_keep_their_share_under_a_continuous_flood_of_highs() {
    let f = required_fixture(30).await;
    send(
        &f.queue,
        (0..20)
            .map(|n| message_of("bulk", n, Priority::Low))
            .collect(),
    )
    .await;
    let mut got = Vec::new();
    for round in 0..12 {
        // Ten new highs before every receive: the high queue never empties.
        send(
            &f.queue,
            (0..10).map(|n| message("otp", round * 10 + n)).collect(),
        )
        .await;
        let batch = f
            .queue
            .receive(Lane::Fast, 10, Duration::from_secs(1))
            .await
            .unwrap();
        delete_all(&f.queue, &batch).await;
        got.extend(batch.into_iter().map(|m| m.priority));
    }
    let lows = got.iter().filter(|&&p| p == Priority::Low).count();
    let highs = got.iter().filter(|&&p| p == Priority::High).count();
    eprintln!("{highs} high and {lows} low of {} received", got.len());
    // The share rule owes low one turn per ten highs (share 0.1).
    assert!(lows >= got.len() / 11 - 1, "{highs} high, {lows} low");
    assert!(lows > 0 && highs > 4 * lows, "{highs} high, {lows} low");
}

#[tokio::test]
async fn defer_dead_letter_and_redrive_route_by_class() {
    let f = required_fixture(30).await;
    send(
        &f.queue,
        vec![message("acme", 1), message_of("acme", 2, Priority::Low)],
    )
    .await;
    let got = receive_n(&f.queue, 2).await;
    let high = got.iter().find(|m| m.priority == Priority::High).unwrap();
    let low = got.iter().find(|m| m.priority == Priority::Low).unwrap();
    assert!(low.receipt.starts_with("low:"), "{}", low.receipt);

    f.queue
        .defer(Lane::Fast, low, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(f.visible("fast-low").await, 1);
    f.queue.dead_letter(Lane::Fast, high).await.unwrap();
    assert_eq!(
        (f.visible("fast-high").await, f.visible("fast-dlq").await),
        (0, 1)
    );
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (1, 0, 1));

    let redriven = f
        .queue
        .redrive(Lane::Fast, &RedriveFilter::default())
        .await
        .unwrap();
    assert_eq!(redriven, vec!["acme-1"]);
    assert_eq!(
        (
            f.visible("fast-high").await,
            f.visible("fast").await,
            f.visible("fast-dlq").await
        ),
        (1, 0, 0)
    );

    // A high message left in the normal queue by a deployment from before
    // priority classes moves to the high queue when deferred.
    let legacy = message("acme", 3);
    let normal_url = f.url("fast").await;
    send_envelopes(&f.client, &normal_url, &[Envelope::of(&legacy)])
        .await
        .unwrap();
    let back = receive_n(&f.queue, 2).await;
    let old = back.iter().find(|m| m.message_id == "acme-3").unwrap();
    assert!(old.receipt.starts_with("normal:"), "{}", old.receipt);
    assert_eq!(old.priority, Priority::High);
    f.queue
        .defer(Lane::Fast, old, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(
        (f.visible("fast-high").await, f.visible("fast").await),
        (1, 0)
    );
}

#[tokio::test]
async fn an_idle_lane_costs_one_receive_per_class_queue_per_wait() {
    let f = required_fixture(30).await;
    let wait = Duration::from_secs(2);
    let before = f.queue.api_calls();
    let started = Instant::now();
    let window = Duration::from_millis(6500);
    let mut receives = 0;
    while started.elapsed() < window {
        let got = f.queue.receive(Lane::Fast, 10, wait).await.unwrap();
        assert!(got.is_empty());
        receives += 1;
    }
    let calls = f.queue.api_calls() - before;
    eprintln!("{receives} receives of an idle lane in {window:?}: {calls} SQS calls");
    // Polls of 2 s started at 0, 2, 4 and 6 s on each of the three class
    // queues: with the 20 s default, three per queue a minute.
    let per_queue = window.as_secs_f64() / wait.as_secs_f64();
    assert!(
        calls as f64 <= 3.0 * (per_queue.floor() + 1.0),
        "{calls} calls"
    );
    assert!(
        calls >= 9,
        "{calls} calls: the class queues were not polled"
    );
}

#[tokio::test]
async fn release_prefetched_gives_back_the_stashes_and_late_polls_give_back_theirs() {
    let f = required_fixture(30).await;
    send(
        &f.queue,
        (0..5)
            .map(|n| message_of("acme", n, Priority::Low))
            .collect(),
    )
    .await;
    let got = f
        .queue
        .receive(Lane::Fast, 1, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    f.stashed([0, 0, 4]).await;
    f.queue.release_prefetched(Lane::Fast).await;
    f.stashed([0, 0, 0]).await;
    assert_eq!(f.visible("fast-low").await, 4);
    // The high queue's poll is still waiting; what it brings goes back.
    send(&f.queue, vec![message("acme", 9)]).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while f.visible("fast-high").await == 0 {
        assert!(Instant::now() < deadline, "the late poll kept its message");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(f.queue.receiver(Lane::Fast).stashed(), [0, 0, 0]);
}

#[tokio::test]
async fn stashed_messages_are_extended_while_the_lane_is_received_from_and_released_when_not() {
    // Visibility 4 s: a stashed message is stale after 2 s.
    let f = required_fixture(4).await;
    send(
        &f.queue,
        (0..3)
            .map(|n| message_of("acme", n, Priority::Low))
            .collect(),
    )
    .await;
    let first = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    delete_all(&f.queue, &first).await;
    f.stashed([0, 0, 2]).await;
    // A receive running past 2 s keeps the lane active: the stash is
    // extended, not released, so the receive count stays at one.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let second = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(second[0].receive_count, 1);
    delete_all(&f.queue, &second).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let third = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    // 3 s after its receive, past the first 4 s only through the extension.
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].receive_count, 1);
    delete_all(&f.queue, &third).await;

    // Nothing receives: a stashed message goes back to the queue.
    send(
        &f.queue,
        (3..5)
            .map(|n| message_of("acme", n, Priority::Low))
            .collect(),
    )
    .await;
    let got = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    delete_all(&f.queue, &got).await;
    f.stashed([0, 0, 1]).await;
    let deadline = Instant::now() + Duration::from_secs(3);
    while f.visible("fast-low").await == 0 {
        assert!(Instant::now() < deadline, "the stash was never released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(f.queue.receiver(Lane::Fast).stashed(), [0, 0, 0]);
}

#[tokio::test]
async fn a_send_batch_of_mixed_classes_reports_per_message_in_order() {
    let f = required_fixture(30).await;
    let messages = vec![
        message_of("acme", 1, Priority::Low),
        message("acme", 2),
        message_of("acme", 3, Priority::Normal),
        message_of("acme", 4, Priority::Low),
    ];
    let results = f.queue.send_batch(Lane::Fast, messages).await.unwrap();
    assert_eq!(results, vec![Ok(()); 4]);
    assert_eq!(
        (
            f.visible("fast-high").await,
            f.visible("fast").await,
            f.visible("fast-low").await
        ),
        (1, 1, 2)
    );
}

#[test]
fn delays_round_up_to_whole_seconds_within_the_sqs_limit() {
    assert_eq!(ceil_secs(Duration::ZERO, MAX_DELAY_SECS), 0);
    assert_eq!(ceil_secs(Duration::from_millis(1), MAX_DELAY_SECS), 1);
    assert_eq!(ceil_secs(Duration::from_millis(1500), MAX_DELAY_SECS), 2);
    assert_eq!(ceil_secs(Duration::from_secs(3600), MAX_DELAY_SECS), 900);
}

#[test]
fn batch_results_map_failed_entries_back_to_their_inputs() {
    let failed = BatchResultErrorEntry::builder()
        .id("1")
        .sender_fault(true)
        .code("ReceiptHandleIsInvalid")
        .message("bad receipt")
        .build()
        .unwrap();
    assert_eq!(
        entry_results(3, ["0"], &[failed]),
        vec![
            Ok(()),
            Err("ReceiptHandleIsInvalid: bad receipt".to_owned()),
            Err("SQS did not report on this entry".to_owned()),
        ]
    );
    let ranges: Vec<_> = chunks(25).collect();
    assert_eq!(ranges, vec![0..10, 10..20, 20..25]);
}

/// Sends `noisy` normal messages of tenant `noisy`, then one of `quiet`.
async fn noisy_backlog_then_quiet(f: &Fixture, noisy: usize) {
    let normal = |tenant: &str, n: usize| message_of(tenant, n, Priority::Normal);
    for start in (0..noisy).step_by(10) {
        send(
            &f.queue,
            (start..(start + 10).min(noisy))
                .map(|n| normal("noisy", n))
                .collect(),
        )
        .await;
    }
    send(&f.queue, vec![normal("quiet", 0)]).await;
}

/// Looks past `noisy`'s messages as a consumer at its parking bound does:
/// a skipping receive, and after one that hands out nothing, a wait for
/// the arrival its polls bring. Returns what was handed out, or nothing
/// once a look started no poll that brought anything within 2 s.
async fn look_past_noisy(f: &Fixture) -> Vec<ReceivedMessage> {
    let skip: HashSet<String> = HashSet::from(["noisy".to_owned()]);
    loop {
        let seen = f.queue.arrivals_so_far(Lane::Fast);
        let found = f
            .queue
            .receive_skipping(Lane::Fast, 1, skip.clone())
            .await
            .unwrap();
        if !found.is_empty() {
            return found;
        }
        let arrived = tokio::time::timeout(Duration::from_secs(2), async {
            while f.queue.arrivals_so_far(Lane::Fast) == seen {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        if arrived.is_err() {
            return Vec::new();
        }
    }
}

/// Issue 30, item 5 on SQS: at the consumer's parking bound, a receive that
/// skips the capped tenant hands out another tenant's message found 150
/// deep behind the capped one's backlog (past the 100 the first version
/// reached), polling past the backlog to find it, and leaves the capped
/// tenant's messages stashed for later receives.
#[tokio::test]
async fn a_skipping_receive_polls_past_a_capped_tenants_backlog_to_another_tenants_message() {
    let f = required_fixture(30).await;
    noisy_backlog_then_quiet(&f, 150).await;
    let arrivals_before = f.queue.arrivals_so_far(Lane::Fast);
    let found = look_past_noisy(&f).await;
    assert_eq!(ids(&found), ["quiet-0"]);
    assert!(f.queue.arrivals_so_far(Lane::Fast) > arrivals_before);
    // Polls still reading when the quiet message turned up bring the rest.
    // Several read at once, and moto (like SQS, at least once) may hand a
    // message to two of them: the stash may hold a copy more.
    let receiver = f.queue.receiver(Lane::Fast);
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.stashed()[Priority::Normal.rank()] < 150 {
        assert!(
            Instant::now() < deadline,
            "stashes hold {:?}",
            receiver.stashed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Ordinary receives hand out the noisy backlog that was looked past.
    let rest = receive_n(&f.queue, 200).await;
    let noisy: HashSet<&str> = rest
        .iter()
        .filter(|m| m.tenant_id == "noisy")
        .map(|m| m.message_id.as_str())
        .collect();
    assert_eq!(noisy.len(), 150);
    assert!(
        rest.iter()
            .all(|m| m.tenant_id == "noisy" || m.message_id == "quiet-0")
    );
    // Clean-up only: a copy's receipt may be stale by now.
    let receipts: Vec<String> = found
        .iter()
        .chain(&rest)
        .map(|m| m.receipt.clone())
        .collect();
    let _ = f.queue.delete_batch(Lane::Fast, &receipts).await;
}

/// The look-ahead bounds what a lane holds while it looks past capped
/// tenants: with `look_ahead_messages` 20, a quiet message 45 deep is not
/// reached, the stash stops at exactly 20, and polling stops there.
#[tokio::test]
async fn looking_past_a_capped_tenant_stops_at_the_look_ahead() {
    let url = required_server_url();
    let prefix = unique_prefix();
    let mut settings = settings_with(&url, &prefix, true, 5, 30);
    settings.queue.sqs.look_ahead_messages = 20;
    let f = fixture_from(&url, prefix, &settings).await;
    noisy_backlog_then_quiet(&f, 45).await;
    assert!(look_past_noisy(&f).await.is_empty());
    assert_eq!(f.queue.receiver(Lane::Fast).stashed(), [0, 20, 0]);
    let arrivals = f.queue.arrivals_so_far(Lane::Fast);
    assert!(look_past_noisy(&f).await.is_empty());
    assert_eq!(f.queue.arrivals_so_far(Lane::Fast), arrivals);
    assert_eq!(f.visible("fast").await, 26);
    f.queue.release_prefetched(Lane::Fast).await;
}

/// Reading ahead goes on only while the consumer keeps looking: a looking
/// long poll that answers after the consumer stopped looking (it left its
/// parking bound) brings its one batch and starts no further reading.
#[tokio::test]
async fn reading_ahead_stops_once_the_consumer_stops_looking() {
    let f = required_fixture(30).await;
    let skip: HashSet<String> = HashSet::from(["noisy".to_owned()]);
    // A look at an empty lane leaves long polls waiting.
    let found = f.queue.receive_skipping(Lane::Fast, 1, skip).await.unwrap();
    assert!(found.is_empty());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    noisy_backlog_then_quiet(&f, 45).await;
    let receiver = f.queue.receiver(Lane::Fast);
    let deadline = Instant::now() + Duration::from_secs(10);
    while receiver.stashed()[Priority::Normal.rank()] == 0 {
        assert!(Instant::now() < deadline, "the long poll brought nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stashed = receiver.stashed()[Priority::Normal.rank()];
    assert!(
        stashed <= 10,
        "{stashed} read ahead after the looks stopped"
    );
    assert!(f.visible("fast").await >= 36);
    f.queue.release_prefetched(Lane::Fast).await;
}
