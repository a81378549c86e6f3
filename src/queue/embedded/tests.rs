//! Tests of the embedded queue through its [`LaneQueue`] face, on a
//! SQLite file of their own, reopened where a restart or a crash matters.

use super::*;
use crate::config::Settings;
use crate::model::{Channel, Priority};

async fn open_queue(dir: &tempfile::TempDir, max_receive_count: u32) -> EmbeddedQueue {
    let db = SqliteDb::open(&dir.path().join("q.db"), false)
        .await
        .unwrap();
    let mut lanes = Settings::from_toml_overlay("").unwrap().lanes;
    lanes.fast.visibility_timeout_secs = 1;
    lanes.fast.max_receive_count = max_receive_count;
    let (writer, _stopped) = StoreWriter::spawn(&db, 512).unwrap();
    EmbeddedQueue::open(db, lanes, writer).await.unwrap()
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

/// Receives the fast lane's one message `receives` times, giving it back
/// at once each time; the receive after that finds it exhausted and moves
/// it to the dead-letter queue instead.
async fn receive_until_dead_lettered(queue: &EmbeddedQueue, receives: u32) {
    for expected in 1..=receives {
        let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(got[0].receive_count, expected);
        queue
            .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
            .await
            .unwrap();
    }
    assert!(
        queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn a_received_message_is_invisible_until_its_visibility_timeout_ends() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();

    let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].receive_count, 1);
    assert!(
        queue
            .receive(Lane::Fast, 10, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (0, 1));

    // A long poll wakes when the timeout ends, with the count raised.
    let again = queue
        .receive(Lane::Fast, 10, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].receive_count, 2);
    assert_eq!(again[0].message_id, "a-1");

    // The first receipt is stale now; the fresh one deletes.
    let stale = queue
        .delete_batch(Lane::Fast, &[first[0].receipt.clone()])
        .await
        .unwrap();
    assert!(stale[0].is_err());
    let fresh = queue
        .delete_batch(Lane::Fast, &[again[0].receipt.clone()])
        .await
        .unwrap();
    assert!(fresh[0].is_ok());
    assert_eq!(
        queue.stats(Lane::Fast).await.unwrap(),
        QueueStats::default()
    );
    assert_eq!(queue.deleted_total(Lane::Fast), 1);
}

#[tokio::test]
async fn visibility_zero_returns_a_message_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    let changed = queue
        .change_visibility_batch(Lane::Fast, &[(got[0].receipt.clone(), Duration::ZERO)])
        .await
        .unwrap();
    assert!(changed[0].is_ok());
    let again = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].receive_count, 2);
}

#[tokio::test]
async fn a_message_received_max_receive_count_times_moves_to_the_dlq() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 2).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    // The third receive finds it exhausted and moves it instead.
    receive_until_dead_lettered(&queue, 2).await;
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight, stats.dlq_depth), (0, 0, 1));
    let dead = queue.list_dead_letters(Lane::Fast, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "a-1");
    assert_eq!(dead[0].receive_count, 2);

    // Redrive brings it back with a fresh receive count.
    let redriven = queue
        .redrive(Lane::Fast, &RedriveFilter::default())
        .await
        .unwrap();
    assert_eq!(redriven, vec!["a-1".to_owned()]);
    let back = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(back[0].receive_count, 1);
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 0);
}

/// The move to the DLQ by receive count and the message's move to
/// `dead_lettered` are one commit: a dead letter never says `queued`
/// (issue 67).
#[tokio::test]
async fn a_message_received_max_receive_count_times_is_dead_lettered_with_its_status() {
    use crate::store::Db;
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 2).await;
    let db = Db::open(&dir.path().join("q.db"), false).await.unwrap();
    db.test_execute(
        "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, \
         created_at, updated_at) VALUES ('a-1', 'a', 'sms', 'queued', 'normal', 'fast', 0, 1, 1)",
    )
    .await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    receive_until_dead_lettered(&queue, 2).await;
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 1);
    let row = db
        .test_texts(
            "SELECT status, last_error, CAST(attempts AS TEXT) FROM messages WHERE id = 'a-1'",
        )
        .await;
    assert_eq!(
        row,
        [vec![
            Some("dead_lettered".to_owned()),
            Some(crate::queue::RECEIVED_TOO_OFTEN.to_owned()),
            Some("0".to_owned())
        ]]
    );
}

#[tokio::test]
async fn a_deferred_message_does_not_count_toward_the_dlq() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 2).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    for _ in 0..5 {
        let got = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
        assert_eq!(
            got.len(),
            1,
            "a deferred message must come back, not go to the DLQ"
        );
        assert_eq!(got[0].receive_count, 1);
        queue
            .defer(Lane::Fast, &got[0], Duration::ZERO)
            .await
            .unwrap();
    }
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 0);
}

#[tokio::test]
async fn redrive_can_select_by_tenant_and_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(
            Lane::Fast,
            vec![message("a", 1), message("a", 2), message("b", 1)],
        )
        .await
        .unwrap();
    for got in queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap() {
        queue.dead_letter(Lane::Fast, &got).await.unwrap();
    }
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 3);
    let by_id = RedriveFilter {
        tenant_id: None,
        message_ids: Some(vec!["a-2".into()]),
    };
    assert_eq!(
        queue.redrive(Lane::Fast, &by_id).await.unwrap(),
        vec!["a-2".to_owned()]
    );
    let by_tenant = RedriveFilter {
        tenant_id: Some("b".into()),
        message_ids: None,
    };
    assert_eq!(
        queue.redrive(Lane::Fast, &by_tenant).await.unwrap(),
        vec!["b-1".to_owned()]
    );
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().dlq_depth, 1);
}

#[tokio::test]
async fn a_delayed_message_is_not_received_before_its_delay() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    let mut delayed = message("a", 1);
    delayed.delay = Duration::from_millis(700);
    queue.send_batch(Lane::Fast, vec![delayed]).await.unwrap();
    assert!(
        queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.delayed), (1, 1));
    let started = std::time::Instant::now();
    let got = queue
        .receive(Lane::Fast, 1, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(got.len(), 1);
    assert!(started.elapsed() >= Duration::from_millis(500));
}

#[tokio::test]
async fn one_tenants_backlog_does_not_sit_in_front_of_another_tenants_first_message() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    let backlog: Vec<_> = (0..500).map(|n| message("big", n)).collect();
    queue.send_batch(Lane::Fast, backlog).await.unwrap();
    // The consumer has started on the backlog.
    let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    assert!(first.iter().all(|m| m.tenant_id == "big"));
    queue
        .send_batch(Lane::Fast, vec![message("small", 0)])
        .await
        .unwrap();
    let next = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    let position = next.iter().position(|m| m.tenant_id == "small");
    assert!(
        position.is_some_and(|p| p <= 1),
        "small tenant's message should be among the next two, got {:?}",
        next.iter().map(|m| &m.message_id).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn two_backlogged_tenants_are_served_alternately() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(Lane::Fast, (0..100).map(|n| message("a", n)).collect())
        .await
        .unwrap();
    queue
        .send_batch(Lane::Fast, (0..100).map(|n| message("b", n)).collect())
        .await
        .unwrap();
    let got = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    let from_a = got.iter().filter(|m| m.tenant_id == "a").count();
    assert_eq!(
        from_a,
        5,
        "{:?}",
        got.iter().map(|m| &m.message_id).collect::<Vec<_>>()
    );
}

fn with_priority(mut message: OutboundMessage, priority: Priority) -> OutboundMessage {
    message.priority = priority;
    message
}

#[tokio::test]
async fn a_high_message_queued_behind_a_low_backlog_is_received_first() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    let lows = (0..300).map(|n| with_priority(message("a", n), Priority::Low));
    queue.send_batch(Lane::Fast, lows.collect()).await.unwrap();
    queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    queue
        .send_batch(
            Lane::Fast,
            vec![
                with_priority(message("a", 1000), Priority::Normal),
                with_priority(message("a", 1001), Priority::High),
            ],
        )
        .await
        .unwrap();
    let next = queue.receive(Lane::Fast, 3, Duration::ZERO).await.unwrap();
    let ids: Vec<_> = next.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids[..2], ["a-1001", "a-1000"], "{ids:?}");
    assert_eq!(next[2].priority, Priority::Low);
}

#[tokio::test]
async fn low_messages_keep_their_share_under_a_flood_of_high_ones() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    let mut flood: Vec<_> = (0..200)
        .map(|n| with_priority(message("a", n), Priority::High))
        .collect();
    flood.extend((200..300).map(|n| with_priority(message("b", n), Priority::Low)));
    queue.send_batch(Lane::Fast, flood).await.unwrap();
    let mut lows = 0;
    for _ in 0..10 {
        let got = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
        assert_eq!(got.len(), 10);
        lows += got.iter().filter(|m| m.priority == Priority::Low).count();
    }
    // The default share is 0.1: 100 received while high floods, at least
    // one in eleven of them low.
    assert!((9..=10).contains(&lows), "{lows} lows of 100");
}

#[tokio::test]
async fn a_deferred_message_goes_behind_its_tenants_other_messages() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(Lane::Fast, (0..4).map(|n| message("a", n)).collect())
        .await
        .unwrap();
    let first = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(first[0].message_id, "a-0");
    queue
        .defer(Lane::Fast, &first[0], Duration::ZERO)
        .await
        .unwrap();
    let rest = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    let ids: Vec<_> = rest.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids, ["a-1", "a-2", "a-3", "a-0"]);
}

#[tokio::test]
async fn a_held_tenants_messages_are_set_aside_once_and_come_back_in_order_when_released() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue.set_tenant_held("held", true).await.unwrap();
    let mut batch: Vec<_> = (0..20).map(|n| message("held", n)).collect();
    batch.push(with_priority(message("held", 99), Priority::High));
    batch.extend((0..3).map(|n| message("free", n)));
    queue.send_batch(Lane::Fast, batch).await.unwrap();
    let got = queue.receive(Lane::Fast, 50, Duration::ZERO).await.unwrap();
    assert!(got.iter().all(|m| m.tenant_id == "free"), "{got:?}");
    assert_eq!(got.len(), 3);
    let receipts: Vec<String> = got.into_iter().map(|m| m.receipt).collect();
    queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.held, stats.depth), (21, 0));
    // Nothing more to hand out, and nothing churns.
    assert!(
        queue
            .receive(Lane::Fast, 50, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );

    // Still held after a restart; released by the next process.
    queue.db.close().await;
    let queue = open_queue(&dir, 5).await;
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().held, 21);
    queue.release_unheld().await.unwrap();
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.held, stats.depth), (0, 21));
    let back = queue.receive(Lane::Fast, 50, Duration::ZERO).await.unwrap();
    let ids: Vec<_> = back.iter().map(|m| m.message_id.as_str()).collect();
    let mut expected = vec!["held-99".to_owned()];
    expected.extend((0..20).map(|n| format!("held-{n}")));
    assert_eq!(ids, expected);
    assert!(back.iter().all(|m| m.receive_count == 1));
}

#[tokio::test]
async fn a_released_tenant_takes_turns_with_others_instead_of_jumping_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue.set_tenant_held("a", true).await.unwrap();
    queue
        .send_batch(Lane::Fast, (0..30).map(|n| message("a", n)).collect())
        .await
        .unwrap();
    queue
        .send_batch(Lane::Fast, (0..30).map(|n| message("b", n)).collect())
        .await
        .unwrap();
    let first = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    assert!(first.iter().all(|m| m.tenant_id == "b"));
    queue.set_tenant_held("a", false).await.unwrap();
    let next = queue.receive(Lane::Fast, 10, Duration::ZERO).await.unwrap();
    let from_a = next.iter().filter(|m| m.tenant_id == "a").count();
    assert!((4..=6).contains(&from_a), "{next:?}");
}

#[tokio::test]
async fn a_receive_abandoned_while_the_writer_works_gives_its_messages_back_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    // Hold the write turn so the writer waits for it with the receive
    // in hand, then abandon the receive, as a consumer shutting down
    // mid-poll does.
    let busy = queue.db.write_turn().await;
    let abandoned = tokio::time::timeout(
        Duration::from_millis(50),
        queue.receive_now(Lane::Fast, 10, None),
    )
    .await;
    assert!(abandoned.is_err());
    drop(busy);
    let again = queue
        .receive(Lane::Fast, 10, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "the abandoned lease was not given back");
    assert_eq!(again[0].receive_count, 1);
}

/// The lane's figures as a scan of the table sees them, to check the
/// counters kept with the writes.
async fn scanned(queue: &EmbeddedQueue) -> (u64, u64, u64) {
    let count = |name: &'static str| async move {
        let sql = "SELECT COUNT(*) FROM queue_messages WHERE queue = ?";
        let args = crate::store::sqlite::args![name.to_owned()];
        let (count,): (i64,) = queue
            .db
            .row(sql, args, crate::store::sqlite::tuple)
            .await
            .unwrap()
            .unwrap();
        count as u64
    };
    (
        count("fast").await,
        count("fast-dlq").await,
        count("fast-held").await,
    )
}

#[tokio::test]
async fn a_first_receive_writes_nothing_and_a_crash_forgets_at_most_one_receive() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 2).await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    let stored = |queue: &EmbeddedQueue| {
        let db = queue.db.clone();
        async move {
            let sql =
                "SELECT receive_count, visible_at FROM queue_messages WHERE message_id = 'a-1'";
            let row: Option<(i64, i64)> = db
                .row(sql, vec![], crate::store::sqlite::tuple)
                .await
                .unwrap();
            row.unwrap()
        }
    };
    let before = stored(&queue).await;
    let first = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(first[0].receive_count, 1);
    assert_eq!(
        stored(&queue).await,
        before,
        "a first receive is not written"
    );

    // A crash (a new process on the file) loses the lease and the
    // unwritten first receive: the message is received as a first time.
    let queue = open_queue(&dir, 2).await;
    let again = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(again[0].receive_count, 1);
    queue
        .change_visibility_batch(Lane::Fast, &[(again[0].receipt.clone(), Duration::ZERO)])
        .await
        .unwrap();
    let second = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(second[0].receive_count, 2);
    assert_eq!(
        stored(&queue).await.0,
        2,
        "a receive after the first is written"
    );

    // After another crash the written count holds: the message is
    // exhausted and moves to the DLQ, one receive later than without
    // the crashes, never more.
    let queue = open_queue(&dir, 2).await;
    assert!(
        queue
            .receive(Lane::Fast, 1, Duration::ZERO)
            .await
            .unwrap()
            .is_empty()
    );
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.dlq_depth), (0, 1));
}

#[tokio::test]
async fn the_counters_kept_with_the_writes_match_a_scan_of_the_table() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 2).await;
    queue.set_tenant_held("held", true).await.unwrap();
    let mut batch: Vec<_> = (0..30).map(|n| message("a", n)).collect();
    batch.extend((0..5).map(|n| message("held", n)));
    let mut later = message("a", 100);
    later.delay = Duration::from_secs(60);
    batch.push(later);
    queue.send_batch(Lane::Fast, batch).await.unwrap();

    let got = queue.receive(Lane::Fast, 20, Duration::ZERO).await.unwrap();
    assert_eq!(got.len(), 20);
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!(
        (stats.in_flight, stats.delayed, stats.held),
        (20, 1, 5),
        "{stats:?}"
    );
    let (deleted, rest) = got.split_at(10);
    let receipts: Vec<String> = deleted.iter().map(|m| m.receipt.clone()).collect();
    queue.delete_batch(Lane::Fast, &receipts).await.unwrap();
    queue.dead_letter(Lane::Fast, &rest[0]).await.unwrap();
    queue.dead_letter(Lane::Fast, &rest[1]).await.unwrap();
    queue
        .defer(Lane::Fast, &rest[2], Duration::from_secs(30))
        .await
        .unwrap();
    queue
        .defer(Lane::Fast, &rest[3], Duration::ZERO)
        .await
        .unwrap();
    queue
        .redrive(
            Lane::Fast,
            &RedriveFilter {
                tenant_id: None,
                message_ids: Some(vec![rest[0].message_id.clone()]),
            },
        )
        .await
        .unwrap();
    queue.set_tenant_held("held", false).await.unwrap();

    let stats = queue.stats(Lane::Fast).await.unwrap();
    let (rows, dlq, held) = scanned(&queue).await;
    assert_eq!(stats.depth + stats.in_flight, rows, "{stats:?}");
    assert_eq!((stats.dlq_depth, stats.held), (dlq, held));
    assert_eq!((dlq, held), (1, 0));
    assert_eq!(stats.in_flight, 6, "{stats:?}");
    assert_eq!(stats.delayed, 2, "the delayed send and the 30 s deferral");
    assert!(stats.oldest_age_secs.is_some());

    // A new process counts the same from the table.
    let reopened = open_queue(&dir, 2).await;
    let fresh = reopened.stats(Lane::Fast).await.unwrap();
    assert_eq!(fresh.depth, rows, "leases do not survive a restart");
    assert_eq!((fresh.dlq_depth, fresh.held, fresh.delayed), (1, 0, 2));
}

#[tokio::test]
async fn messages_and_fairness_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    {
        let queue = open_queue(&dir, 5).await;
        queue
            .send_batch(Lane::Fast, (0..50).map(|n| message("a", n)).collect())
            .await
            .unwrap();
        queue.db.close().await;
    }
    let queue = open_queue(&dir, 5).await;
    assert_eq!(queue.stats(Lane::Fast).await.unwrap().depth, 50);
    queue
        .send_batch(Lane::Fast, vec![message("b", 0)])
        .await
        .unwrap();
    let got = queue.receive(Lane::Fast, 2, Duration::ZERO).await.unwrap();
    assert!(got.iter().any(|m| m.tenant_id == "b"));
}

#[tokio::test]
async fn a_skipping_receive_takes_another_tenants_message_past_a_backlog_and_leaves_the_backlog() {
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 5).await;
    let backlog: Vec<OutboundMessage> = (0..200).map(|n| message("noisy", n)).collect();
    queue.send_batch(Lane::Fast, backlog).await.unwrap();
    // The consumer has taken some of the backlog (leased, in flight).
    let taken = queue.receive(Lane::Fast, 40, Duration::ZERO).await.unwrap();
    assert_eq!(taken.len(), 40);
    queue
        .send_batch(Lane::Fast, vec![message("quiet", 1)])
        .await
        .unwrap();

    let skip = std::collections::HashSet::from(["noisy".to_owned()]);
    let got = queue
        .receive_skipping(Lane::Fast, 1, skip.clone())
        .await
        .unwrap();
    let ids: Vec<&str> = got.iter().map(|m| m.message_id.as_str()).collect();
    assert_eq!(ids, ["quiet-1"]);
    // Nothing else to take: the backlog stays where it was.
    assert!(
        queue
            .receive_skipping(Lane::Fast, 5, skip)
            .await
            .unwrap()
            .is_empty()
    );
    let stats = queue.stats(Lane::Fast).await.unwrap();
    assert_eq!((stats.depth, stats.in_flight), (160, 41));
    // An ordinary receive goes on with the backlog in its order.
    let next = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(next[0].message_id, "noisy-40");
}

#[tokio::test]
async fn an_arrival_wakes_a_waiter_on_its_lane() {
    let dir = tempfile::tempdir().unwrap();
    let queue = Arc::new(open_queue(&dir, 5).await);
    let waiting = tokio::spawn({
        let queue = queue.clone();
        async move { queue.arrival(Lane::Fast).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!waiting.is_finished(), "nothing has arrived yet");
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("the arrival wakes the waiter")
        .unwrap();
}

/// Retention reads which messages are due, then erases their waiting
/// copies and their personal data; a redrive that lands between the two
/// puts the message back to be sent, and it must keep its queue row and its
/// data, or it would stay `queued` forever with nothing to send.
#[tokio::test]
async fn a_redrive_landing_between_retentions_read_and_its_erasure_loses_nothing() {
    use crate::store::Db;
    let dir = tempfile::tempdir().unwrap();
    let queue = open_queue(&dir, 1).await;
    let db = Db::open(&dir.path().join("q.db"), false).await.unwrap();
    db.test_execute(
        "INSERT INTO messages (id, tenant_id, channel, status, priority, lane, attempts, \
         reference, created_at, updated_at) \
         VALUES ('a-1', 'a', 'sms', 'queued', 'normal', 'fast', 0, 'order-1', 1, 1)",
    )
    .await;
    queue
        .send_batch(Lane::Fast, vec![message("a", 1)])
        .await
        .unwrap();
    // Past its one receive: dead-lettered, and due for retention.
    receive_until_dead_lettered(&queue, 1).await;
    let due = db.due_for_erasure("a", i64::MAX, 10).await.unwrap();
    assert_eq!(due.len(), 1);
    assert_eq!(due[0].status, "dead_lettered");

    // The redrive lands, then retention goes on with what it read.
    let redriven = queue
        .redrive(Lane::Fast, &RedriveFilter::default())
        .await
        .unwrap();
    assert_eq!(redriven, vec!["a-1".to_owned()]);
    let ids = vec!["a-1".to_owned()];
    assert!(
        queue
            .erase_waiting("a", Some(&ids))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(db.erase_messages(&ids, 2).await.unwrap(), 0);

    let row = db
        .test_texts("SELECT status, reference FROM messages WHERE id = 'a-1'")
        .await;
    assert_eq!(
        row,
        [vec![Some("queued".to_owned()), Some("order-1".to_owned())]]
    );
    let back = queue.receive(Lane::Fast, 1, Duration::ZERO).await.unwrap();
    assert_eq!(back.len(), 1, "the redriven copy is still there to send");
    assert_eq!(back[0].message_id, "a-1");
}
