//! Tests against a local SQS-compatible server (moto) at
//! `FAIRLANE_TEST_SQS_URL`.

use super::batch::{chunks, entry_results};
use super::lanes::{MAX_RETENTION_SECS, queue_url};
use super::*;
use crate::config::Settings;
use crate::model::{Channel, Priority};
use aws_sdk_sqs::config::Credentials;
use aws_sdk_sqs::config::retry::RetryConfig;
use aws_sdk_sqs::types::BatchResultErrorEntry;

/// The local SQS-compatible server (moto) the tests run against.
fn server_url() -> Option<String> {
    match std::env::var("FAIRLANE_TEST_SQS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            eprintln!("skipping: FAIRLANE_TEST_SQS_URL is not set");
            None
        }
    }
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
    Settings::from_toml_overlay(&format!(
        "[queue.sqs]\nendpoint_url = \"{url}\"\nregion = \"us-east-1\"\n\
         queue_prefix = \"{prefix}\"\ncreate_queues = {create}\n\
         [lanes.fast]\nvisibility_timeout_secs = 30\nmax_receive_count = {max_receive_count}\n"
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
}

/// A queue with fresh lane queues, or `None` without a server.
async fn fixture(max_receive_count: u32) -> Option<Fixture> {
    let url = server_url()?;
    let prefix = unique_prefix();
    let settings = settings(&url, &prefix, true, max_receive_count);
    let mut queue = SqsQueue::connect_with_client(
        test_client(&url),
        &settings.queue.sqs,
        settings.lanes.clone(),
    )
    .await
    .unwrap();
    // Fresh statistics on every call (caching has a test of its own).
    queue.stats_interval = Duration::ZERO;
    Some(Fixture {
        queue,
        client: test_client(&url),
        prefix,
    })
}

fn message(tenant: &str, n: usize) -> OutboundMessage {
    OutboundMessage {
        message_id: format!("{tenant}-{n}"),
        tenant_id: tenant.to_owned(),
        channel: Channel::Sms,
        priority: Priority::High,
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
    for _ in 0..5 {
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
    let fast_url = queue_url(&client, &format!("{prefix}-fast")).await.unwrap();
    let fast = queue_attributes(&client, &fast_url, &[QueueAttributeName::All])
        .await
        .unwrap();
    assert_eq!(fast[&QueueAttributeName::VisibilityTimeout], "45");
    let policy: serde_json::Value =
        serde_json::from_str(&fast[&QueueAttributeName::RedrivePolicy]).unwrap();
    assert_eq!(
        policy["deadLetterTargetArn"],
        dlq[&QueueAttributeName::QueueArn].as_str()
    );
    assert_eq!(policy["maxReceiveCount"].to_string().trim_matches('"'), "7");
    assert_eq!(
        dlq[&QueueAttributeName::MessageRetentionPeriod],
        MAX_RETENTION_SECS.to_string()
    );
    assert_eq!(
        fast[&QueueAttributeName::MessageRetentionPeriod],
        MAX_RETENTION_SECS.to_string()
    );
    // The slow lane has its own pair.
    queue_url(&client, &format!("{prefix}-slow")).await.unwrap();
    queue_url(&client, &format!("{prefix}-slow-dlq"))
        .await
        .unwrap();
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
        text.contains(&format!("SQS queue {prefix}-fast does not exist"))
            && text.contains("queue.sqs.create_queues = true"),
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
    let Some(url) = server_url() else { return };
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
        eprintln!("skipping: AWS_ACCESS_KEY_ID is not set (any value works with moto)");
        return;
    }
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

    let url = f.url("fast").await;
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

#[tokio::test]
async fn a_message_received_max_receive_count_times_moves_to_the_dlq() {
    let Some(f) = fixture(2).await else { return };
    send(&f.queue, vec![message("acme", 1)]).await;
    for expected in 1..=2 {
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
    assert_eq!(dead[0].receive_count, 2);
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
    assert_eq!(f.queue.api_calls() - before, 2, "lane and DLQ attributes");
    send(&f.queue, vec![message("acme", 1)]).await;
    let calls = f.queue.api_calls();
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap(), first);
    assert_eq!(f.queue.api_calls(), calls, "served from the cache");
    // Each lane has its own entry.
    f.queue.stats(Lane::Slow).await.unwrap();
    assert_eq!(f.queue.api_calls() - calls, 2);
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
async fn stats_count_waiting_in_flight_delayed_and_dead_messages() {
    let Some(f) = fixture(5).await else { return };
    let mut delayed = message("acme", 4);
    delayed.delay = Duration::from_secs(60);
    send(
        &f.queue,
        vec![
            message("acme", 1),
            message("acme", 2),
            message("acme", 3),
            delayed,
        ],
    )
    .await;
    f.queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    let doomed = f
        .queue
        .receive(Lane::Fast, 1, Duration::ZERO)
        .await
        .unwrap();
    f.queue.dead_letter(Lane::Fast, &doomed[0]).await.unwrap();
    assert_eq!(
        f.queue.stats(Lane::Fast).await.unwrap(),
        QueueStats {
            depth: 2,
            in_flight: 1,
            delayed: 1,
            oldest_age_secs: None,
            dlq_depth: 1,
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
    let got = f
        .queue
        .receive(Lane::Fast, 10, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(got.len(), 10);
    assert_eq!(f.queue.api_calls() - start, 2);
    let receipts: Vec<String> = got.iter().map(|m| m.receipt.clone()).collect();
    f.queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    assert_eq!(f.queue.api_calls() - start, 3);
    f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(f.queue.api_calls() - start, 5);
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
