//! Against the PostgreSQL `crate::test_servers` finds or starts
//! (`FAIRLANE_TEST_PG_URL`, default 5432): each test makes a
//! database of its own and drops it at the end, even when it fails.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Connection, Executor, PgConnection};

use super::*;
use crate::model::{Channel, Lane, MessageStatus, Priority, Scope, World, now_ms};
use crate::queue::OutboundMessage;
use crate::store::idempotency::{self, StoredResponse};
use crate::store::messages::MessageRecord;
use crate::store::{AcceptEntry, Db, Writer};

/// A database of the test's own, dropped with this value.
pub(crate) struct TestDatabase {
    pub url: String,
    server: String,
    name: String,
}

impl TestDatabase {
    pub(crate) async fn create() -> TestDatabase {
        let server = crate::test_servers::pg_url();
        let mut admin = PgConnection::connect(&server).await.unwrap_or_else(|err| {
            panic!(
                "no PostgreSQL answers at {server} (FAIRLANE_TEST_PG_URL): these tests need a real \
                 PostgreSQL server: {err}"
            )
        });
        let name = format!("fairlane_test_{}", crate::tenants::random_hex(6));
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .expect("create the test database");
        let (base, _) = server.rsplit_once('/').expect("a database URL");
        TestDatabase {
            url: format!("{base}/{name}"),
            server,
            name,
        }
    }

    pub(crate) async fn open(&self) -> Db {
        Db::Postgres(PgDb::connect(&self.url).await.expect("connect and migrate"))
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let (server, name) = (self.server.clone(), self.name.clone());
        // A thread of its own: Drop may run inside a runtime.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let mut admin = PgConnection::connect(&server).await?;
                admin
                    .execute(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .await?;
                anyhow::Ok(())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

pub(crate) fn entry(id: &str, tenant: &str, key: Option<&str>) -> AcceptEntry {
    let now = now_ms();
    AcceptEntry {
        lane: Lane::Fast,
        record: MessageRecord {
            id: id.into(),
            tenant_id: tenant.into(),
            channel: Channel::Sms,
            status: MessageStatus::Queued,
            priority: Priority::Normal,
            lane: Lane::Fast,
            attempts: 0,
            reference: Some(format!("ref-{id}")),
            metadata: None,
            created_at: now,
            updated_at: now,
            sent_at: None,
            last_error: None,
            provider_message_id: None,
            send_at: None,
            test: false,
            fragments: None,
            erased_at: None,
            provider: None,
            recipient: Some(format!("+1555{id}")),
            gate_wait_ms: None,
            template_id: None,
            template_version: None,
            attachment_bytes: None,
        },
        outbound: OutboundMessage {
            message_id: id.into(),
            tenant_id: tenant.into(),
            channel: Channel::Sms,
            priority: Priority::Normal,
            body: format!("{{\"id\":\"{id}\"}}"),
            delay: Duration::ZERO,
        },
        idempotency: Vec::from_iter(key.map(|key| StoredResponse {
            tenant_id: tenant.into(),
            test: false,
            key: key.into(),
            request_hash: "h".into(),
            status_code: 202,
            response_body: "{}".into(),
            message_id: id.into(),
            created_at: now,
            claimed_as: None,
        })),
        trace: None,
    }
}

pub(crate) async fn count(db: &Db, sql: &str) -> i64 {
    let pg = db.postgres().unwrap();
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(&pg.pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_and_status_changes_commit_in_groups_and_read_back() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    let (writer, done) = Writer::start(&db, 64, 0).unwrap();
    let accept = Arc::new(writer.clone());
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let accept = accept.clone();
            tokio::spawn(async move {
                let key = (i % 2 == 0).then(|| format!("key-{i}"));
                accept
                    .accept(entry(&format!("m{i}"), "acme", key.as_deref()))
                    .await
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap().expect("accepted");
    }
    assert_eq!(count(&db, "SELECT COUNT(*) FROM messages").await, 200);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM outbox").await, 200);
    assert_eq!(
        count(&db, "SELECT COUNT(*) FROM idempotency_keys").await,
        100
    );
    let remembered = db
        .remembered_answer(&Scope::new("acme", World::Live), "key-4", now_ms())
        .await
        .unwrap()
        .expect("remembered");
    assert_eq!(remembered.message_id, "m4");
    assert!(
        db.remembered_answer(&Scope::new("acme", World::Test), "key-4", now_ms())
            .await
            .unwrap()
            .is_none(),
        "a live key's answer is not remembered in the test world"
    );

    let status = writer.clone();
    assert!(status.claim("m1", 0).await.unwrap());
    status.sent_by("m1", "SM1", None).await.unwrap();
    assert!(
        !status.claim("m1", 0).await.unwrap(),
        "a late claim never takes a sent message back"
    );
    let attempts = status
        .failure("m2", MessageStatus::Retrying, "503 from provider", true)
        .await
        .unwrap();
    assert_eq!(attempts, 1);
    let unknown = status
        .failure("nope", MessageStatus::Retrying, "x", true)
        .await
        .unwrap();
    assert_eq!(unknown, 0, "an unknown id changes nothing");
    writer.stop().await;
    done.await.unwrap();
    assert!(accept.accept(entry("late", "acme", None)).await.is_err());

    let sent = db.message("m1").await.unwrap().unwrap();
    assert_eq!(sent.status, MessageStatus::Sent);
    assert_eq!(sent.attempts, 1);
    assert_eq!(sent.provider_message_id.as_deref(), Some("SM1"));
    let live = |tenant: &str| Scope::new(tenant, World::Live);
    let retrying = db.message_in(&live("acme"), "m2").await.unwrap().unwrap();
    assert_eq!(retrying.status, MessageStatus::Retrying);
    assert_eq!(retrying.last_error.as_deref(), Some("503 from provider"));
    assert!(db.message_in(&live("other"), "m2").await.unwrap().is_none());
    assert!(
        db.message_in(&Scope::new("acme", World::Test), "m2")
            .await
            .unwrap()
            .is_none(),
        "a live message is not found in the tenant's test world"
    );
    let many = db
        .messages_by_id(&["m3".into(), "m5".into(), "zz".into()])
        .await
        .unwrap();
    assert_eq!(many.len(), 2);
    assert_eq!(db.live_count_since("acme", 0).await.unwrap(), 200);
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_counts_tell_the_backlog_and_the_oldest_event_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::webhooks::tests::counts_tell_the_backlog_and_the_oldest_event(&db).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_stream_is_read_in_order_by_one_instance_at_a_time_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::webhooks::tests::a_stream_is_read_in_order_by_one_instance_at_a_time(&db).await;
    db.close().await;
}

/// An event's id is taken at insert, not at commit: a stream must not pass
/// an event whose transaction is still open, though a later one (a higher
/// id) has committed. Read by id alone, or by (xid, id) without the
/// snapshot's horizon, the open one would be behind the read once it
/// commits, and never delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_stream_does_not_pass_an_event_still_to_commit() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    let pool = db.postgres().unwrap().pool.clone();
    for sql in [
        "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0, 60, 0)",
        "INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
         VALUES ('t', 't', 'p', 'active', 0, 0)",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let endpoint = crate::store::webhooks::Endpoint {
        url: "https://example.com/h",
        events: " message.sent ",
        max_events_per_call: 1,
    };
    db.put_webhook("t", &endpoint, "s".into()).await.unwrap();
    const EVENT: &str = "INSERT INTO message_events (message_id, tenant_id, at, event, status, attempts) \
         VALUES ($1, 't', 0, 'sent', 'sent', 1)";
    let mut open = pool.begin().await.unwrap();
    sqlx::query(EVENT)
        .bind("early")
        .execute(&mut *open)
        .await
        .unwrap();
    sqlx::query(EVENT)
        .bind("late")
        .execute(&pool)
        .await
        .unwrap();
    let (writer, _done) = PgWriter::spawn(db.postgres().unwrap(), 64);
    let now = now_ms();
    let rooms = || crate::store::PassRooms {
        tenants: Default::default(),
        default_room: 10,
        owner: "a".into(),
        stream_until: now + 60_000,
    };
    let messages = |taken: Vec<crate::store::TakenCalls>| -> Vec<String> {
        taken
            .into_iter()
            .flat_map(|take| take.calls)
            .map(|call| call.message_id)
            .collect()
    };
    let before = writer.take_pass(rooms(), now, now + 60_000).await.unwrap();
    assert!(
        messages(before).is_empty(),
        "`late` was read while `early`, before it, had not committed"
    );
    open.commit().await.unwrap();
    // Other tests' transactions on this server may hold the horizon back
    // a moment: a few passes, until both are read.
    let mut read = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while read.len() < 2 && Instant::now() < deadline {
        read.extend(messages(
            writer.take_pass(rooms(), now, now + 60_000).await.unwrap(),
        ));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(read, ["early", "late"]);
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_send_reads_what_it_is_asked_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::hot::tests::before_send_reads_status_and_suppression_in_order(&db).await;
    db.close().await;
}

/// The lifecycle's moves on PostgreSQL: each writes its event, webhook
/// call and usage delta in its own statement, with no trigger left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_write_what_the_lifecycle_says_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::lifecycle::tests::moves_write_what_the_lifecycle_says(&db).await;
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_piece_fails_alone_and_the_rest_of_its_group_commits() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    let (writer, _done) = PgWriter::spawn(db.postgres().unwrap(), 64);
    // Submitted together, so they share a group; "dup" twice breaks the
    // primary key.
    let (a, d1, d2, c) = tokio::join!(
        writer.accept(vec![entry("a", "t", None)]),
        writer.accept(vec![entry("dup", "t", None)]),
        writer.accept(vec![entry("dup", "t", None)]),
        writer.accept(vec![entry("c", "t", None)]),
    );
    assert!(a && c);
    assert!(d1 != d2, "exactly one of the two copies commits");
    assert_eq!(count(&db, "SELECT COUNT(*) FROM messages").await, 3);
    assert_eq!(count(&db, "SELECT COUNT(*) FROM outbox").await, 3);
    db.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_instances_claiming_one_message_exactly_one_gets_it() {
    let database = TestDatabase::create().await;
    let (one, two) = (database.open().await, database.open().await);
    let (first, _) = PgWriter::spawn(one.postgres().unwrap(), 64);
    let (second, _) = PgWriter::spawn(two.postgres().unwrap(), 64);
    for i in 0..50 {
        assert!(first.accept(vec![entry(&format!("m{i}"), "t", None)]).await);
    }
    let stale_before = now_ms() - 60_000;
    let claims: Vec<_> = (0..50)
        .map(|i| {
            let (first, second) = (first.clone(), second.clone());
            tokio::spawn(async move {
                let id = format!("m{i}");
                let (a, b) = tokio::join!(
                    first.claim(&id, stale_before),
                    second.claim(&id, stale_before)
                );
                (a.unwrap(), b.unwrap())
            })
        })
        .collect();
    for claim in claims {
        let (a, b) = claim.await.unwrap();
        assert!(a != b, "exactly one of the two claims succeeds ({a}, {b})");
    }
    // A sent message is claimed by nobody; a claim older than
    // `stale_before` (its sender died) is taken over.
    first.sent("m0", "SM0", None, Some(12)).await.unwrap();
    assert!(!second.claim("m0", now_ms() + 1).await.unwrap());
    assert!(!second.claim("m1", now_ms() - 60_000).await.unwrap());
    assert!(second.claim("m1", now_ms() + 1).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_once_lock_is_held_by_one_instance_at_a_time() {
    let database = TestDatabase::create().await;
    let (first, second) = (database.open().await, database.open().await);
    let (first, second) = (first.postgres().unwrap(), second.postgres().unwrap());
    let held = try_lock(first, locks::OUTBOX_SWEEP)
        .await
        .unwrap()
        .expect("free at first");
    assert!(
        try_lock(second, locks::OUTBOX_SWEEP)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        try_lock(second, locks::IDEMPOTENCY_PURGE)
            .await
            .unwrap()
            .is_some(),
        "another job's lock is independent"
    );
    held.commit().await.unwrap();
    assert!(
        try_lock(second, locks::OUTBOX_SWEEP)
            .await
            .unwrap()
            .is_some()
    );
    // The purge runs under its lock and reports what it removed.
    let old = now_ms() - idempotency::RETENTION_MS - 1;
    sqlx::query(
        "INSERT INTO idempotency_keys VALUES ('t', 'k', 'h', 202, '{}', 'm', $1), ('t', 'k2', 'h', 202, '{}', 'm2', $2)",
    )
    .bind(old)
    .bind(now_ms())
    .execute(&first.pool)
    .await
    .unwrap();
    let db = Db::Postgres(first.clone());
    assert_eq!(db.purge_idempotency_keys(now_ms()).await.unwrap(), Some(1));
    let blocker = try_lock(second, locks::IDEMPOTENCY_PURGE)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        db.purge_idempotency_keys(now_ms()).await.unwrap(),
        None,
        "skipped while another instance purges"
    );
    blocker.rollback().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_change_made_through_one_instance_reaches_another_within_a_second() {
    let database = TestDatabase::create().await;
    let plans = crate::config::Settings::from_toml_overlay("")
        .unwrap()
        .plans;
    let a = Arc::new(
        crate::tenants::Registry::load(database.open().await, &plans)
            .await
            .unwrap(),
    );
    let b = Arc::new(
        crate::tenants::Registry::load(database.open().await, &plans)
            .await
            .unwrap(),
    );
    let (_stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(b.clone().follow(stopped));
    // The follower's first reload tells us it listens.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let within_a_second = |check: &dyn Fn() -> bool| {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(1) {
            if check() {
                return Some(started.elapsed());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    };
    a.create_tenant("acme", "Acme", "pro", Default::default())
        .await
        .unwrap();
    let (key_id, key) = a
        .issue_key("acme", crate::tenants::KeyKind::Live)
        .await
        .unwrap();
    let seen = tokio::task::block_in_place(|| within_a_second(&|| b.authenticate(&key).is_some()));
    assert!(seen.is_some(), "the new key works on the other instance");

    let sender = a
        .add_sender(
            "acme",
            &crate::tenants::NewSender {
                channel: Channel::Sms,
                from: Some("ACME".into()),
                display_name: None,
                reply_to: Vec::new(),
                configuration_set: None,
                messaging_service_sid: None,
                default: true,
            },
        )
        .await
        .unwrap();
    let heard = tokio::task::block_in_place(|| {
        within_a_second(&|| {
            b.authenticate(&key).is_some_and(|caller| {
                caller
                    .senders
                    .iter()
                    .any(|s| s.id == sender.id && s.default)
            })
        })
    });
    assert!(
        heard.is_some(),
        "the new sender identity reaches the other instance"
    );
    a.remove_sender("acme", &sender.id).await.unwrap();
    let forgotten = tokio::task::block_in_place(|| {
        within_a_second(&|| {
            b.authenticate(&key)
                .is_some_and(|caller| caller.senders.is_empty())
        })
    });
    assert!(
        forgotten.is_some(),
        "a removed identity is gone on the other instance"
    );

    a.update_tenant(
        "acme",
        &crate::tenants::TenantChange {
            plan: Some("basic".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let moved = tokio::task::block_in_place(|| {
        within_a_second(&|| b.tenant("acme").is_some_and(|t| t.plan == "basic"))
    });
    assert!(
        moved.is_some(),
        "the plan change reaches the other instance"
    );

    a.revoke_key("acme", &key_id).await.unwrap();
    let refused =
        tokio::task::block_in_place(|| within_a_second(&|| b.authenticate(&key).is_none()));
    assert!(
        refused.is_some(),
        "a revoked key is refused on the other instance within 1 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receipt_moves_only_what_its_provider_sent_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::receipts::tests::a_receipt_moves_only_what_its_provider_sent(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_serve_many_sends_until_expired_or_deleted_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    db.test_execute(
        "INSERT INTO plans VALUES ('p', 'fast', 1, 1, 1, 1, 'admin', 0, 60, 0); \
         INSERT INTO tenants (id, name, plan, status, created_at, updated_at) \
         VALUES ('acme', 'a', 'p', 'active', 0, 0);",
    )
    .await;
    crate::store::attachments::tests::files_serve_many_sends_until_expired_or_deleted(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recipients_keep_their_own_statuses_on_postgres() {
    let database = TestDatabase::create().await;
    let db = database.open().await;
    crate::store::receipts::tests::recipients_keep_their_own_statuses(&db).await;
}

fn receipt(
    provider_id: &str,
    outcome: Option<MessageStatus>,
    event: &str,
    detail: Option<&str>,
) -> crate::store::receipts::Receipt {
    crate::store::receipts::Receipt {
        provider: "http".into(),
        provider_message_id: provider_id.into(),
        // The id the provider carries back: the test's messages are m1
        // (SM1) and m2 (SM2); another sid names none.
        message_id: match provider_id {
            "SM1" => Some("m1".into()),
            "SM2" => Some("m2".into()),
            _ => None,
        },
        outcome,
        event: event.into(),
        detail: detail.map(str::to_owned),
        suppress: Vec::new(),
        suppress_reason: None,
        recipients: Vec::new(),
    }
}

/// A group's receipts are decided in order, as if applied one after
/// another: a later report on the same message sees the earlier one's
/// status and event, a replay within the group or of an earlier group is
/// a duplicate, and only the last move of a message stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_receipts_reads_as_the_same_receipts_one_by_one() {
    use crate::store::postgres::receipts::apply_group as apply_group_pg;
    use crate::store::receipts::Applied;
    use MessageStatus::{Complained, Delivered};
    let database = TestDatabase::create().await;
    let db = database.open().await;
    let (writer, done) = Writer::start(&db, 64, 0).unwrap();
    for (id, sid) in [("m1", "SM1"), ("m2", "SM2")] {
        writer.accept(entry(id, "acme", None)).await.unwrap();
        assert!(writer.claim(id, 0).await.unwrap());
        writer.sent_by(id, sid, None).await.unwrap();
    }
    writer.stop().await;
    done.await.unwrap();
    let pg = db.postgres().unwrap();

    let mut complaint = receipt("SM1", Some(Complained), "complained", Some("abuse"));
    complaint.suppress = vec!["Someone@Example.com".into()];
    complaint.suppress_reason = Some("complaint".into());
    let first = [
        receipt("SM1", Some(Delivered), "delivered", None),
        complaint.clone(),
        receipt("SM1", Some(Delivered), "delivered", None),
        receipt("SM1", Some(Delivered), "delivered", None),
        receipt("SM2", None, "sms_sent", Some("carrier")),
        receipt("SMX", Some(Delivered), "delivered", None),
        receipt("SM2", Some(Delivered), "delivered", None),
        receipt("SM2", Some(Delivered), "delivered", None),
    ];
    let second = [receipt("SM2", None, "sms_sent", Some("carrier")), complaint];
    // Compared without `sent_at` (checked by the receipts' own tests).
    let matched = |id: &str, changed| Applied::Matched {
        message_id: id.into(),
        tenant_id: "acme".into(),
        changed,
        sent_at: None,
    };
    let mut answers = Vec::new();
    for group in [&first[..], &second[..]] {
        let mut tx = pg.pool.begin().await.unwrap();
        let refs: Vec<_> = group.iter().collect();
        let applied = apply_group_pg(&mut tx, &refs, now_ms()).await.unwrap();
        answers.push(
            applied
                .into_iter()
                .map(|answer| match answer {
                    Applied::Matched {
                        message_id,
                        tenant_id,
                        changed,
                        ..
                    } => Applied::Matched {
                        message_id,
                        tenant_id,
                        changed,
                        sent_at: None,
                    },
                    other => other,
                })
                .collect::<Vec<_>>(),
        );
        tx.commit().await.unwrap();
    }
    assert_eq!(
        answers[0],
        [
            matched("m1", true),
            matched("m1", true),
            matched("m1", false),
            Applied::Duplicate,
            matched("m2", false),
            Applied::Unmatched,
            matched("m2", true),
            Applied::Duplicate,
        ]
    );
    assert_eq!(answers[1], [Applied::Duplicate, Applied::Duplicate]);

    let statuses: Vec<(String, String, Option<String>)> =
        sqlx::query_as("SELECT id, status, last_error FROM messages ORDER BY id")
            .fetch_all(&pg.pool)
            .await
            .unwrap();
    assert_eq!(
        statuses,
        [
            ("m1".into(), "complained".into(), Some("abuse".into())),
            ("m2".into(), "delivered".into(), None),
        ]
    );
    let events: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT message_id, event, status FROM message_events ORDER BY message_id, id",
    )
    .fetch_all(&pg.pool)
    .await
    .unwrap();
    let expected = [
        ("m1", "delivered", "delivered"),
        ("m1", "complained", "complained"),
        ("m1", "provider_delivered", "complained"),
        ("m2", "sms_sent", "sent"),
        ("m2", "delivered", "delivered"),
    ];
    assert_eq!(
        events,
        expected.map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()))
    );
    let suppressed: Vec<(String, String)> =
        sqlx::query_as("SELECT address, reason FROM suppressions")
            .fetch_all(&pg.pool)
            .await
            .unwrap();
    assert_eq!(
        suppressed,
        [("someone@example.com".to_owned(), "complaint".to_owned())]
    );
    db.close().await;
}

/// `entry` answering the claim `token` on `key`.
fn claimed_entry(id: &str, key: &str, token: &str) -> AcceptEntry {
    let mut entry = entry(id, "acme", Some(key));
    entry.idempotency[0].claimed_as = Some(token.to_owned());
    entry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_idempotency_key_is_claimed_once_answered_in_the_accepts_commit_and_never_replaced() {
    use idempotency::KeyClaim;
    let database = TestDatabase::create().await;
    // Two instances: two connections to the same database.
    let (one, two) = (database.open().await, database.open().await);
    let scope = Scope::new("acme", World::Live);
    let now = now_ms();
    assert_eq!(
        one.claim_key(&scope, "k", "h", "token-1", now)
            .await
            .unwrap(),
        KeyClaim::Claimed { durable: true }
    );
    // The second instance finds it claimed and unanswered: 409.
    assert!(matches!(
        two.claim_key(&scope, "k", "h", "token-2", now)
            .await
            .unwrap(),
        KeyClaim::Pending { .. }
    ));
    assert!(
        two.remembered_answer(&scope, "k", now)
            .await
            .unwrap()
            .is_none(),
        "a claim is no answer"
    );
    // The first accept commits with the answer written over its claim.
    let (writer, done) = Writer::start(&one, 64, 0).unwrap();
    writer
        .accept(claimed_entry("m1", "k", "token-1"))
        .await
        .expect("accepted");
    match two
        .claim_key(&scope, "k", "h", "token-3", now)
        .await
        .unwrap()
    {
        KeyClaim::Answered(stored) => assert_eq!(stored.message_id, "m1"),
        other => panic!("expected the answer, got {other:?}"),
    }

    // A claim left unanswered goes stale and a retry takes it over; the
    // first accept, committing after that, fails whole.
    let late = now + idempotency::CLAIM_STALE_MS + 1;
    assert_eq!(
        one.claim_key(&scope, "k2", "h", "old", now).await.unwrap(),
        KeyClaim::Claimed { durable: true }
    );
    assert!(matches!(
        two.claim_key(&scope, "k2", "h", "new", now + 1_000)
            .await
            .unwrap(),
        KeyClaim::Pending { .. }
    ));
    assert_eq!(
        two.claim_key(&scope, "k2", "h", "new", late).await.unwrap(),
        KeyClaim::Claimed { durable: true }
    );
    assert!(
        writer
            .accept(claimed_entry("m2", "k2", "old"))
            .await
            .is_err(),
        "the stale claim's accept must not commit"
    );
    assert_eq!(
        count(&one, "SELECT COUNT(*) FROM messages WHERE id = 'm2'").await,
        0,
        "nothing of the refused accept was written"
    );
    writer
        .accept(claimed_entry("m3", "k2", "new"))
        .await
        .expect("the retry's accept commits");
    let answer = one.remembered_answer(&scope, "k2", late).await.unwrap();
    assert_eq!(answer.map(|a| a.message_id), Some("m3".to_owned()));

    // A claim given up (its request was refused) frees the key.
    assert_eq!(
        one.claim_key(&scope, "k3", "h", "t", now).await.unwrap(),
        KeyClaim::Claimed { durable: true }
    );
    one.release_key(&scope, "k3", "t").await.unwrap();
    assert_eq!(
        two.claim_key(&scope, "k3", "h", "u", now).await.unwrap(),
        KeyClaim::Claimed { durable: true }
    );
    // Releasing with another token, or an answered key, changes nothing.
    one.release_key(&scope, "k", "token-1").await.unwrap();
    assert!(
        one.remembered_answer(&scope, "k", now)
            .await
            .unwrap()
            .is_some()
    );
    writer.stop().await;
    done.await.unwrap();
    one.close().await;
    two.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_of_the_same_key_on_two_instances_at_once_make_one_winner() {
    use idempotency::KeyClaim;
    let database = TestDatabase::create().await;
    let dbs: Vec<Db> = futures_util::future::join_all((0..4).map(|_| database.open())).await;
    let scope = Scope::new("acme", World::Live);
    for round in 0..20 {
        let key = format!("key-{round}");
        let claims = futures_util::future::join_all(dbs.iter().enumerate().map(|(i, db)| {
            let (scope, key) = (scope.clone(), key.clone());
            async move {
                db.claim_key(&scope, &key, "h", &format!("t{i}"), now_ms())
                    .await
                    .unwrap()
            }
        }))
        .await;
        let won = claims
            .iter()
            .filter(|claim| matches!(claim, KeyClaim::Claimed { .. }))
            .count();
        assert_eq!(won, 1, "round {round}: {claims:?}");
    }
    for db in dbs {
        db.close().await;
    }
}
