//! Tests of the lanes in PostgreSQL through their [`LaneQueue`] face, on a
//! database of their own on the test PostgreSQL server; two handles on one
//! database stand for two instances.

use std::collections::HashMap;

use super::*;
use crate::config::Settings;
use crate::model::{Channel, MessageStatus, Priority};
use crate::queue::{RECEIVED_TOO_OFTEN, TenantQueues};
use crate::store::postgres::tests::{TestDatabase, entry};
use crate::store::{Db, Staging, Writer};

struct Fixture {
    queue: Arc<PgLanes>,
    db: Db,
    _database: TestDatabase,
}

async fn fixture(max_receive_count: u32) -> Fixture {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    let queue = open(&db, max_receive_count).await;
    Fixture {
        queue,
        db,
        _database: database,
    }
}

/// Another instance's handle on the same lanes.
async fn open(db: &Db, max_receive_count: u32) -> Arc<PgLanes> {
    let mut lanes = Settings::from_toml_overlay("").unwrap().lanes;
    lanes.fast.visibility_timeout_secs = 1;
    lanes.fast.max_receive_count = max_receive_count;
    PgLanes::open(db.lanes_engine().unwrap(), lanes)
        .await
        .unwrap()
}

fn message(tenant: &str, n: usize) -> OutboundMessage {
    OutboundMessage {
        message_id: format!("{tenant}-{n}"),
        tenant_id: tenant.to_owned(),
        channel: Channel::Sms,
        priority: Priority::Normal,
        body: format!("{{\"n\":{n}}}"),
        delay: Duration::ZERO,
    }
}

fn with_priority(mut message: OutboundMessage, priority: Priority) -> OutboundMessage {
    message.priority = priority;
    message
}

async fn send(queue: &PgLanes, messages: Vec<OutboundMessage>) {
    let results = queue.send_batch(Lane::Fast, messages).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

async fn receive(queue: &PgLanes, max: usize) -> Vec<ReceivedMessage> {
    queue
        .receive(Lane::Fast, max, Duration::ZERO)
        .await
        .unwrap()
}

fn ids(messages: &[ReceivedMessage]) -> Vec<&str> {
    messages.iter().map(|m| m.message_id.as_str()).collect()
}

async fn delete(queue: &PgLanes, messages: &[ReceivedMessage]) {
    let receipts: Vec<String> = messages.iter().map(|m| m.receipt.clone()).collect();
    let results = queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

#[tokio::test]
async fn a_received_message_is_invisible_until_its_visibility_timeout_ends() {
    let f = fixture(5).await;
    send(&f.queue, vec![message("a", 1)]).await;
    let first = receive(&f.queue, 10).await;
    assert_eq!(ids(&first), ["a-1"]);
    assert_eq!(first[0].receive_count, 1);
    assert_eq!(first[0].status_at_receive, None, "no status row");
    assert!(receive(&f.queue, 10).await.is_empty());
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 1), "{stats:?}");

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = receive(&f.queue, 10).await;
    assert_eq!(ids(&again), ["a-1"]);
    assert_eq!(again[0].receive_count, 2);
    // The first receipt went stale with the second receive.
    let stale = f
        .queue
        .delete_batch(Lane::Fast, &[first[0].receipt.clone(), "bogus".to_owned()])
        .await
        .unwrap();
    assert!(stale[0].is_err() && stale[1].is_err(), "{stale:?}");
    delete(&f.queue, &again).await;
    assert_eq!(f.queue.deleted_total(Lane::Fast), 1);
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 0), "{stats:?}");
}

/// A deferral that reaches the database only after its lease ran out (the
/// store was away, issue 67) leaves the row to whoever received it since,
/// but gives back the receive its lost lease cost: store outages do not
/// dead-letter healthy messages.
#[tokio::test]
async fn a_deferral_taken_after_its_lease_ran_out_gives_that_receive_back() {
    let f = fixture(2).await;
    send(&f.queue, vec![message("a", 1)]).await;
    let first = receive(&f.queue, 10).await;
    assert_eq!(first[0].receive_count, 1);
    // The lease runs out while the deferral cannot be made; another
    // consumer receives the message.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let second = receive(&f.queue, 10).await;
    assert_eq!(ids(&second), ["a-1"]);
    assert_eq!(second[0].receive_count, 2);
    // The first consumer's deferral gets through now: the row stays the
    // second consumer's (still leased), one receive given back.
    f.queue
        .defer(Lane::Fast, &first[0], Duration::ZERO)
        .await
        .unwrap();
    assert!(
        receive(&f.queue, 10).await.is_empty(),
        "a stale deferral made the row visible under its new holder"
    );
    // The second lease runs out as well (a second outage): received a
    // third time, the message is still within its two counted receives.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let third = receive(&f.queue, 10).await;
    assert_eq!(
        ids(&third),
        ["a-1"],
        "the message was dead-lettered for receives its outages cost"
    );
    assert_eq!(third[0].receive_count, 2);
    let stats = f.queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(stats.dlq_depth, 0, "{stats:?}");
    // The second holder's receipt is as stale as the first's was: its
    // deferral changes nothing but the count.
    f.queue
        .defer(Lane::Fast, &second[0], Duration::ZERO)
        .await
        .unwrap();
    assert!(receive(&f.queue, 10).await.is_empty());
    delete(&f.queue, &third).await;
}

#[tokio::test]
async fn a_message_received_max_receive_count_times_moves_to_the_dlq_and_redrive_brings_it_back() {
    let f = fixture(2).await;
    send(&f.queue, vec![message("a", 1), message("b", 1)]).await;
    for expected in 1..=2 {
        let got = receive(&f.queue, 10).await;
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|m| m.receive_count == expected));
        let back: Vec<(String, Duration)> = got
            .iter()
            .map(|m| (m.receipt.clone(), Duration::ZERO))
            .collect();
        f.queue
            .change_visibility_batch(Lane::Fast, &back)
            .await
            .unwrap();
    }
    assert!(receive(&f.queue, 10).await.is_empty());
    let letters = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    let mut dead: Vec<&str> = letters.iter().map(|l| l.message_id.as_str()).collect();
    dead.sort();
    assert_eq!(dead, ["a-1", "b-1"]);
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap().dlq_depth, 2);

    let by_tenant = RedriveFilter {
        tenant_id: Some("b".into()),
        message_ids: None,
    };
    assert_eq!(
        f.queue.redrive(Lane::Fast, &by_tenant).await.unwrap(),
        ["b-1"]
    );
    let by_id = RedriveFilter {
        tenant_id: None,
        message_ids: Some(vec!["nope".into()]),
    };
    assert!(
        f.queue
            .redrive(Lane::Fast, &by_id)
            .await
            .unwrap()
            .is_empty()
    );
    let got = receive(&f.queue, 10).await;
    assert_eq!(ids(&got), ["b-1"]);
    assert_eq!(got[0].receive_count, 1, "a fresh receive budget");
}

/// The move to the DLQ by receive count and the message's move to
/// `dead_lettered` are one commit: a dead letter never says `queued`
/// (issue 67), and a redrive makes it `queued` again.
#[tokio::test]
async fn a_message_received_max_receive_count_times_is_dead_lettered_with_its_status() {
    let f = fixture(2).await;
    let (writer, _done) = Writer::start(&f.db, 64, 0).unwrap();
    writer.stage_into(Staging::Lanes).unwrap();
    writer
        .accept_all(vec![entry("m1", "t", None)])
        .await
        .unwrap();
    for expected in 1..=2 {
        let got = receive(&f.queue, 10).await;
        assert_eq!(ids(&got), ["m1"]);
        assert_eq!(got[0].receive_count, expected);
        assert_eq!(got[0].status_at_receive, Some(MessageStatus::Queued));
        // Not deleted: its visibility lapses at once.
        let back = [(got[0].receipt.clone(), Duration::ZERO)];
        f.queue
            .change_visibility_batch(Lane::Fast, &back)
            .await
            .unwrap();
    }
    assert!(receive(&f.queue, 10).await.is_empty());
    let letters = f.queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(
        letters
            .iter()
            .map(|l| l.message_id.as_str())
            .collect::<Vec<_>>(),
        ["m1"]
    );
    let record = f.db.message("m1").await.unwrap().unwrap();
    assert_eq!(record.status, MessageStatus::DeadLettered);
    assert_eq!(record.last_error.as_deref(), Some(RECEIVED_TOO_OFTEN));
    assert_eq!(record.attempts, 0, "no attempt counted");
    let events = f.db.message_events("m1").await.unwrap();
    let last = events.last().unwrap();
    assert_eq!(
        (last.event.as_str(), last.detail.as_deref()),
        ("dead_lettered", Some(RECEIVED_TOO_OFTEN)),
        "{events:?}"
    );

    let all = RedriveFilter {
        tenant_id: None,
        message_ids: None,
    };
    assert_eq!(f.queue.redrive(Lane::Fast, &all).await.unwrap(), ["m1"]);
    let record = f.db.message("m1").await.unwrap().unwrap();
    assert_eq!(record.status, MessageStatus::Queued);
    let got = receive(&f.queue, 10).await;
    assert_eq!(ids(&got), ["m1"]);
    assert_eq!(got[0].receive_count, 1);
}

#[tokio::test]
async fn a_deferred_message_waits_its_delay_and_does_not_count_toward_the_dlq() {
    let f = fixture(1).await;
    send(&f.queue, vec![message("a", 1)]).await;
    for _ in 0..3 {
        let got = receive(&f.queue, 1).await;
        assert_eq!(got.len(), 1, "deferrals do not dead-letter");
        f.queue
            .defer(Lane::Fast, &got[0], Duration::from_millis(300))
            .await
            .unwrap();
        assert!(receive(&f.queue, 1).await.is_empty(), "deferred");
        let stats = f.queue.stats(Lane::Fast).await.unwrap();
        assert_eq!((stats.depth, stats.delayed), (1, 1), "{stats:?}");
        tokio::time::sleep(Duration::from_millis(350)).await;
    }
}

#[tokio::test]
async fn a_delayed_message_is_not_received_before_its_delay() {
    let f = fixture(5).await;
    let mut later = message("a", 1);
    later.delay = Duration::from_millis(600);
    send(&f.queue, vec![later, message("a", 2)]).await;
    assert_eq!(ids(&receive(&f.queue, 10).await), ["a-2"]);
    let started = std::time::Instant::now();
    let got = f
        .queue
        .receive(Lane::Fast, 10, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(ids(&got), ["a-1"]);
    assert!(started.elapsed() >= Duration::from_millis(400));
}

#[tokio::test]
async fn one_tenants_backlog_does_not_sit_in_front_of_another_tenants_first_message() {
    let f = fixture(5).await;
    send(&f.queue, (0..500).map(|n| message("noisy", n)).collect()).await;
    let first = receive(&f.queue, 10).await;
    assert!(first.iter().all(|m| m.tenant_id == "noisy"));
    send(&f.queue, vec![message("quiet", 0)]).await;
    let next = receive(&f.queue, 10).await;
    assert!(
        ids(&next).contains(&"quiet-0"),
        "the quiet tenant waits at most one round: {:?}",
        ids(&next)
    );
}

#[tokio::test]
async fn backlogged_tenants_are_served_in_turn() {
    let f = fixture(5).await;
    for tenant in ["a", "b", "c"] {
        send(&f.queue, (0..100).map(|n| message(tenant, n)).collect()).await;
    }
    let mut served: HashMap<String, usize> = HashMap::new();
    for _ in 0..10 {
        let got = receive(&f.queue, 9).await;
        assert_eq!(got.len(), 9);
        for m in &got {
            *served.entry(m.tenant_id.clone()).or_default() += 1;
        }
        delete(&f.queue, &got).await;
    }
    assert_eq!(served["a"], 30, "{served:?}");
    assert_eq!(served["b"], 30, "{served:?}");
    assert_eq!(served["c"], 30, "{served:?}");
    // Each tenant's messages in order.
    let got = receive(&f.queue, 3).await;
    let mut next: Vec<&str> = ids(&got);
    next.sort();
    assert_eq!(next, ["a-30", "b-30", "c-30"]);
}

#[tokio::test]
async fn a_high_message_queued_behind_a_low_backlog_is_received_first() {
    let f = fixture(5).await;
    send(
        &f.queue,
        (0..200)
            .map(|n| with_priority(message("bulk", n), Priority::Low))
            .collect(),
    )
    .await;
    send(
        &f.queue,
        vec![with_priority(message("otp", 0), Priority::High)],
    )
    .await;
    let got = receive(&f.queue, 1).await;
    assert_eq!(ids(&got), ["otp-0"]);
}

#[tokio::test]
async fn low_messages_keep_their_share_under_a_flood_of_high_ones() {
    let f = fixture(5).await;
    send(
        &f.queue,
        (0..400)
            .map(|n| with_priority(message("high", n), Priority::High))
            .collect(),
    )
    .await;
    send(
        &f.queue,
        (0..100)
            .map(|n| with_priority(message("low", n), Priority::Low))
            .collect(),
    )
    .await;
    let mut low = 0;
    for _ in 0..20 {
        let got = receive(&f.queue, 10).await;
        low += got.iter().filter(|m| m.priority == Priority::Low).count();
        delete(&f.queue, &got).await;
    }
    // The default share: at least one in eleven.
    assert!((17..=25).contains(&low), "low got {low} of 200");
}

#[tokio::test]
async fn two_instances_never_hand_out_the_same_message() {
    let f = fixture(5).await;
    let other = open(&f.db, 5).await;
    let messages: Vec<OutboundMessage> = (0..300)
        .map(|n| message(["a", "b", "c"][n % 3], n))
        .collect();
    send(&f.queue, messages).await;
    let mut tasks = Vec::new();
    for queue in [f.queue.clone(), other.clone(), f.queue.clone(), other] {
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = receive(&queue, 7).await;
                if batch.is_empty() {
                    return got;
                }
                got.extend(batch.into_iter().map(|m| m.message_id));
            }
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    let total = all.len();
    all.sort();
    all.dedup();
    assert_eq!((total, all.len()), (300, 300));
}

#[tokio::test]
async fn a_send_on_one_instance_wakes_a_long_poll_on_another() {
    let f = fixture(5).await;
    let other = open(&f.db, 5).await;
    let waiting = tokio::spawn(async move {
        let started = std::time::Instant::now();
        let got = other
            .receive(Lane::Fast, 10, Duration::from_secs(10))
            .await
            .unwrap();
        (got.len(), started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let arrivals = f.queue.arrivals_so_far(Lane::Fast);
    send(&f.queue, vec![message("a", 1)]).await;
    let (got, waited) = waiting.await.unwrap();
    assert_eq!(got, 1);
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    assert!(f.queue.arrivals_so_far(Lane::Fast) > arrivals);
}

#[tokio::test]
async fn a_skipping_receive_takes_another_tenants_message_past_a_backlog() {
    let f = fixture(5).await;
    send(&f.queue, (0..100).map(|n| message("noisy", n)).collect()).await;
    send(&f.queue, vec![message("quiet", 0)]).await;
    let got = f
        .queue
        .receive_skipping(Lane::Fast, 10, HashSet::from(["noisy".to_owned()]))
        .await
        .unwrap();
    assert_eq!(ids(&got), ["quiet-0"]);
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap().depth, 100);
}

/// The accept path writes a message's lane row with its status row; a
/// receive reads the status in the same statement, and a cancel removes
/// the waiting row.
#[tokio::test]
async fn accepted_messages_are_on_their_lane_with_their_status() {
    let f = fixture(5).await;
    let (writer, _done) = Writer::start(&f.db, 64, 0).unwrap();
    writer.stage_into(Staging::Lanes).unwrap();
    writer
        .accept_all(vec![entry("m1", "t", None), entry("m2", "t", None)])
        .await
        .unwrap();
    let scope = crate::model::Scope::new("t", crate::model::World::Live);
    assert_eq!(
        writer.cancel(&scope, vec!["m2".into()]).await.unwrap(),
        ["m2"]
    );
    let got = receive(&f.queue, 10).await;
    assert_eq!(ids(&got), ["m1"]);
    assert_eq!(got[0].status_at_receive, Some(MessageStatus::Queued));
}

/// Retention erases a dead letter's row only while its message is still
/// dead-lettered: a redrive that moved it back first keeps it.
#[tokio::test]
async fn erasure_takes_dead_letters_and_leaves_redriven_ones() {
    let f = fixture(5).await;
    let (writer, _done) = Writer::start(&f.db, 64, 0).unwrap();
    writer.stage_into(Staging::Lanes).unwrap();
    writer
        .accept_all(vec![entry("m1", "t", None), entry("m2", "t", None)])
        .await
        .unwrap();
    let got = receive(&f.queue, 10).await;
    for message in &got {
        f.queue.dead_letter(Lane::Fast, message).await.unwrap();
        writer
            .failure(
                &message.message_id,
                MessageStatus::DeadLettered,
                "boom",
                true,
            )
            .await
            .unwrap();
    }
    let redrive = RedriveFilter {
        tenant_id: None,
        message_ids: Some(vec!["m2".into()]),
    };
    assert_eq!(f.queue.redrive(Lane::Fast, &redrive).await.unwrap(), ["m2"]);
    let erased = f
        .queue
        .erase_waiting("t", Some(&["m1".to_owned(), "m2".to_owned()]))
        .await
        .unwrap();
    assert_eq!(erased, ["m1"]);
    let got = receive(&f.queue, 10).await;
    assert_eq!(ids(&got), ["m2"]);
    assert_eq!(got[0].status_at_receive, Some(MessageStatus::Queued));
    assert_eq!(f.queue.stats(Lane::Fast).await.unwrap().dlq_depth, 0);
}

/// A receive that finds a tenant with nothing left drops its turn, but not
/// while an accept is adding rows under it: the accept holds the turn's
/// lock until it commits, and its rows are then received.
#[tokio::test]
async fn a_turn_is_not_dropped_under_an_accept_in_progress() {
    let f = fixture(5).await;
    send(&f.queue, vec![message("a", 1)]).await;
    delete(&f.queue, &receive(&f.queue, 10).await).await;
    // An accept of tenant a's next message, still open: its lock taken,
    // its row written, nothing committed.
    let pool = f.db.lanes_engine().unwrap().pool.clone();
    let mut accept = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock_shared(hashtextextended('fast:1:a', 0))")
        .execute(&mut *accept)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO lane_messages (queue, class, tenant_id, message_id, channel, priority, body, \
         enqueued_at, visible_at) VALUES ('fast', 1, 'a', 'a-2', 'sms', 'normal', '{}', 0, 0)",
    )
    .execute(&mut *accept)
    .await
    .unwrap();
    // The receive sees tenant a's turn with no row left.
    assert!(receive(&f.queue, 10).await.is_empty());
    accept.commit().await.unwrap();
    let got = receive(&f.queue, 10).await;
    assert_eq!(ids(&got), ["a-2"]);
    // With nothing in the way, an empty turn is dropped.
    delete(&f.queue, &got).await;
    let turns = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM lane_turns")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(turns().await, 1);
    assert!(receive(&f.queue, 10).await.is_empty());
    assert_eq!(turns().await, 0);
}

/// Makes tenant `id` with `isolation` in the tenants table the accept
/// statement routes by.
async fn tenant_row(db: &Db, id: &str, isolation: &str) {
    let pool = &db.lanes_engine().unwrap().pool;
    sqlx::query(
        "INSERT INTO plans (name, lane, rate_per_second, burst, daily_quota, max_in_flight, source, updated_at) \
         VALUES ('p', 'fast', 1, 1, 1, 1, 'config', 0) ON CONFLICT DO NOTHING",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO tenants (id, name, plan, status, created_at, updated_at, isolation) \
         VALUES ($1, $1, 'p', 'active', 0, 0, $2) \
         ON CONFLICT (id) DO UPDATE SET isolation = excluded.isolation",
    )
    .bind(id)
    .bind(isolation)
    .execute(pool)
    .await
    .unwrap();
}

/// Tenant big's own queue in the fast lane.
async fn big_queue(lanes: &PgLanes) -> Arc<dyn LaneQueue> {
    lanes
        .dedicated_queue(Lane::Fast, "big")
        .await
        .unwrap()
        .expect("big's queue")
}

/// What an attention worker does when a slice of big's queue ends: the
/// messages worked and the signal deleted, then the queue settled; returns
/// whether backlog remains.
async fn end_slice(
    lanes: &PgLanes,
    own: &dyn LaneQueue,
    worked: &[ReceivedMessage],
    attention: &dyn LaneQueue,
    signal: &ReceivedMessage,
) -> bool {
    let receipts: Vec<String> = worked.iter().map(|m| m.receipt.clone()).collect();
    own.delete_batch(Lane::Fast, &receipts).await.unwrap();
    attention
        .delete_batch(Lane::Fast, std::slice::from_ref(&signal.receipt))
        .await
        .unwrap();
    lanes.settle_attention(Lane::Fast, "big").await.unwrap()
}

/// A dedicated tenant's messages go to its own queue, with one attention
/// entry for it whatever the number of messages; a shared tenant's stay in
/// the lane. The attention queue hands out the entry, the tenant's queue
/// its messages (high first), and the settle after a slice leaves a new
/// entry only while rows remain.
#[tokio::test]
async fn a_dedicated_tenants_messages_wait_in_its_own_queue_behind_one_attention_entry() {
    let f = fixture(5).await;
    tenant_row(&f.db, "big", "dedicated").await;
    tenant_row(&f.db, "small", "shared").await;
    send(
        &f.queue,
        vec![
            message("big", 1),
            message("big", 2),
            with_priority(message("big", 3), Priority::High),
            message("small", 1),
        ],
    )
    .await;
    assert_eq!(ids(&receive(&f.queue, 10).await), ["small-1"]);
    assert_eq!(f.queue.dedicated_lanes("big").await.unwrap(), [Lane::Fast]);
    assert!(f.queue.dedicated_lanes("small").await.unwrap().is_empty());
    assert!(
        f.queue
            .dedicated_queue(Lane::Fast, "small")
            .await
            .unwrap()
            .is_none()
    );

    let attention = f.queue.attention_queue(Lane::Fast).unwrap();
    let signals = attention
        .receive(Lane::Fast, 10, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(signals.len(), 1, "{signals:?}");
    assert_eq!(signals[0].tenant_id, "big");
    let own = big_queue(&f.queue).await;
    assert_eq!(own.stats(Lane::Fast).await.unwrap().depth, 3);
    let first = own.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(ids(&first), ["big-3"], "high first");
    // A message written while the entry is in flight leaves no second one.
    send(&f.queue, vec![message("big", 4)]).await;
    assert!(
        end_slice(
            &f.queue,
            own.as_ref(),
            &first,
            attention.as_ref(),
            &signals[0]
        )
        .await
    );
    let again = attention
        .receive(Lane::Fast, 10, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "{again:?}");
    let rest = own.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    let mut rest_ids = ids(&rest);
    rest_ids.sort_unstable();
    assert_eq!(rest_ids, ["big-1", "big-2", "big-4"]);
    assert!(!end_slice(&f.queue, own.as_ref(), &rest, attention.as_ref(), &again[0]).await);
    assert!(
        attention
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    // An emptied queue stays listed.
    assert_eq!(own.stats(Lane::Fast).await.unwrap().depth, 0);
    assert_eq!(f.queue.dedicated_lanes("big").await.unwrap(), [Lane::Fast]);
}

/// A tenant queue whose rows all wait for a delay gets an attention entry
/// visible when the first of them comes due; one lost (a crash between a
/// slice and its signal) is made again at start-up.
#[tokio::test]
async fn a_dedicated_queue_is_signalled_when_its_rows_come_due_and_again_at_start_up() {
    let f = fixture(5).await;
    tenant_row(&f.db, "big", "dedicated").await;
    let mut later = message("big", 1);
    later.delay = Duration::from_millis(1500);
    send(&f.queue, vec![later]).await;
    let pool = &f.db.lanes_engine().unwrap().pool;
    sqlx::query("DELETE FROM lane_messages WHERE queue = 'fast:attention'")
        .execute(pool)
        .await
        .unwrap();
    let attention = f.queue.attention_queue(Lane::Fast).unwrap();
    // Another instance starting reconciles: one queue with backlog.
    let other = open(&f.db, 5).await;
    assert_eq!(other.reconcile_attention().await.unwrap(), 1);
    assert!(
        attention
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty(),
        "the entry waits for the row's delay"
    );
    let signal = attention
        .receive(Lane::Fast, 1, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(signal.len(), 1);
    let own = big_queue(&f.queue).await;
    assert_eq!(
        ids(&own.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap()),
        ["big-1"]
    );
}

/// A purge takes the waiting rows of the tenant's own queues and cancels
/// their messages in one transaction; a row a consumer holds stays, and
/// the shared lanes and other tenants are not touched. Tenant deletion then
/// erases what is left, attention entry and listing included.
#[tokio::test]
async fn a_purge_cancels_a_dedicated_tenants_waiting_messages_only() {
    let f = fixture(5).await;
    tenant_row(&f.db, "big", "dedicated").await;
    tenant_row(&f.db, "small", "shared").await;
    let (writer, _done) = Writer::start(&f.db, 64, 0).unwrap();
    writer.stage_into(Staging::Lanes).unwrap();
    writer
        .accept_all(vec![
            entry("b1", "big", None),
            entry("b2", "big", None),
            entry("b3", "big", None),
            entry("s1", "small", None),
        ])
        .await
        .unwrap();
    let own = big_queue(&f.queue).await;
    let held = own.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(ids(&held), ["b1"]);
    let mut purged = f.queue.purge_dedicated("big").await.unwrap();
    purged.sort();
    assert_eq!(purged, ["b2", "b3"]);
    let status = |id: &'static str| {
        let db = f.db.clone();
        async move { db.message(id).await.unwrap().unwrap().status }
    };
    assert_eq!(status("b2").await, MessageStatus::Cancelled);
    assert_eq!(status("b1").await, MessageStatus::Queued);
    assert_eq!(status("s1").await, MessageStatus::Queued);
    assert_eq!(ids(&receive(&f.queue, 10).await), ["s1"]);

    f.queue.erase_waiting("big", None).await.unwrap();
    assert!(f.queue.dedicated_lanes("big").await.unwrap().is_empty());
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM lane_messages WHERE tenant_id = 'big' AND NOT leased",
    )
    .fetch_one(&f.db.lanes_engine().unwrap().pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "the attention entry went with the tenant");
}

/// A dedicated tenant's own queue dead-letters by receive count as the
/// lanes do: the row to its DLQ, the message `dead_lettered`, one commit.
#[tokio::test]
async fn a_dedicated_queue_dead_letters_by_receive_count_with_the_status() {
    let f = fixture(1).await;
    tenant_row(&f.db, "big", "dedicated").await;
    let (writer, _done) = Writer::start(&f.db, 64, 0).unwrap();
    writer.stage_into(Staging::Lanes).unwrap();
    writer
        .accept_all(vec![entry("m1", "big", None)])
        .await
        .unwrap();
    let own = big_queue(&f.queue).await;
    let got = own.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    assert_eq!(ids(&got), ["m1"]);
    let back = [(got[0].receipt.clone(), Duration::ZERO)];
    own.change_visibility_batch(Lane::Fast, &back)
        .await
        .unwrap();
    assert!(
        own.receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(own.stats(Lane::Fast).await.unwrap().dlq_depth, 1);
    let record = f.db.message("m1").await.unwrap().unwrap();
    assert_eq!(record.status, MessageStatus::DeadLettered);
    assert_eq!(record.last_error.as_deref(), Some(RECEIVED_TOO_OFTEN));
}
