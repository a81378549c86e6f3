//! Durable state: tenants, plans, API keys, message status and events,
//! idempotency keys, suppressions, webhooks' rows and the SQS outbox. Every
//! statement of the service's own tables lives under this folder; nothing
//! above it writes SQL or asks which database it talks to.
//!
//! Two backends keep it, chosen by `storage.url`: one SQLite file
//! ([`sqlite`], the default, one instance) or a PostgreSQL database
//! ([`postgres`], shared by several instances; the lanes are then SQS
//! queues). [`Db`] is the one handle the rest of the service holds. It
//! derefs to [`Backend`], the store's interface: one trait per topic
//! (`RegistryStore`, `MessageStore`, `WebhookStore`, …), each declared in
//! the topic's module beside its types and written in the domain's words.
//! Each backend implements every trait in its own folder, one file per
//! topic, and holds all of its SQL there: rusqlite and `?N` parameters on
//! the SQLite file, sqlx and `$N` on PostgreSQL. The hot writes go through
//! one [`Writer`], which hands them to the backend's group-committing
//! writer; a message's status changes only through the lifecycle
//! ([`lifecycle`]), one file per backend.
//!
//! The embedded queue keeps its own tables in the SQLite file and runs its
//! work on the SQLite writer ([`sqlite::writer`]).

pub mod admins;
pub mod attachments;
mod delivery;
mod error;
pub mod events;
mod hot;
pub mod idempotency;
pub(crate) mod lifecycle;
pub mod messages;
pub mod outbox;
pub mod postgres;
pub mod receipts;
pub mod registry;
pub mod retention;
mod settings;
pub mod sqlite;
mod staging;
mod streak;
pub mod suppressions;
pub mod templates;
pub mod usage;
mod usage_counters;
pub mod webhooks;

pub use delivery::{
    BeforeSend, Called, CallsRecord, PassRooms, SendCheck, StreamRead, TakenCalls, TenantRoom,
};
pub use error::{StoreError, StoreResult};
pub use hot::Writer;
pub use sqlite::SqliteDb;
pub(crate) use staging::group_span;
pub use staging::{AcceptEntry, AfterCommit, NotDurable, QueueRows, Staging};
pub use streak::{FailureStreak, WriteFailed};

use std::path::Path;
use std::sync::Arc;

use tokio::sync::oneshot;

use hot::HotPath;
use sqlite::writer::StoreWriter;

pub use crate::config::{is_postgres_url, sqlite_path};

/// The store, on one backend or the other. It derefs to [`Backend`], so
/// every operation is a method: `db.insert_tenant(…)` runs on whichever
/// engine the store is, and only this file asks which.
#[derive(Clone, Debug)]
pub enum Db {
    Sqlite(SqliteDb),
    Postgres(postgres::PgDb),
}

/// Declares [`Backend`] as the sum of the topics' traits, and every type
/// that implements them all as one.
macro_rules! backend {
    ($($topic:ident),+ $(,)?) => {
        /// Everything the service asks of its store, in the domain's words:
        /// one trait per topic, declared beside its types, and implemented
        /// once per engine in [`sqlite`] and [`postgres`], which hold all of
        /// its SQL.
        pub trait Backend: $($topic +)+ Send + Sync {}

        impl<T> Backend for T where T: $($topic +)+ Send + Sync {}
    };
}

backend!(
    AdminStore,
    AttachmentStore,
    RegistryStore,
    MessageStore,
    WebhookStore,
    SuppressionStore,
    OutboxStore,
    IdempotencyStore,
    RetentionStore,
    ReceiptStore,
    UsageStore,
    SettingsStore,
    TemplateStore,
);

impl std::ops::Deref for Db {
    type Target = dyn Backend;

    fn deref(&self) -> &(dyn Backend + 'static) {
        match self {
            Db::Sqlite(db) => db,
            Db::Postgres(db) => db,
        }
    }
}

/// The store's traits, for `use crate::store::prelude::*` where its
/// operations are called.
pub mod prelude {
    pub use super::admins::AdminStore;
    pub use super::attachments::AttachmentStore;
    pub use super::idempotency::IdempotencyStore;
    pub use super::messages::MessageStore;
    pub use super::outbox::OutboxStore;
    pub use super::receipts::ReceiptStore;
    pub use super::registry::RegistryStore;
    pub use super::retention::RetentionStore;
    pub use super::settings::SettingsStore;
    pub use super::suppressions::SuppressionStore;
    pub use super::templates::TemplateStore;
    pub use super::usage::UsageStore;
    pub use super::webhooks::WebhookStore;
}
use prelude::*;

impl Db {
    /// Opens the store `url` names (`sqlite://PATH`, `postgres://…`),
    /// creating and migrating it as needed.
    pub async fn connect(url: &str, fsync: bool) -> anyhow::Result<Db> {
        if is_postgres_url(url) {
            Ok(Db::Postgres(postgres::PgDb::connect(url).await?))
        } else {
            Self::open(&sqlite_path(url), fsync).await
        }
    }

    /// Opens (creating if needed) and migrates the SQLite file at `path`.
    pub async fn open(path: &Path, fsync: bool) -> anyhow::Result<Db> {
        Ok(Db::Sqlite(SqliteDb::open(path, fsync).await?))
    }

    /// Starts the hot path's group-committing writer of this store's
    /// engine (see [`Writer::start`]).
    pub(crate) fn start_hot_path(
        &self,
        max_group: usize,
        max_size_mb: u64,
    ) -> anyhow::Result<(Arc<dyn HotPath>, oneshot::Receiver<()>)> {
        Ok(match self {
            Db::Sqlite(sqlite) => {
                let (writer, done) = StoreWriter::spawn_capped(sqlite, max_group, max_size_mb)?;
                (Arc::new(sqlite::hot::SqliteHot::new(writer)), done)
            }
            Db::Postgres(pg) => {
                let (writer, done) = postgres::PgWriter::spawn(pg, max_group);
                (Arc::new(writer), done)
            }
        })
    }

    /// What the embedded queue lives in: the SQLite file and its writer
    /// thread (`writer`, started on this store), whose groups carry the
    /// queue's own work. Refused, saying why, on another engine.
    pub fn embedded_engine(&self, writer: &Writer) -> anyhow::Result<(SqliteDb, StoreWriter)> {
        match (self, writer.sqlite()) {
            (Db::Sqlite(sqlite), Some(thread)) => Ok((sqlite.clone(), thread.clone())),
            _ => anyhow::bail!(
                "the embedded queue needs a SQLite store (storage.url = \"sqlite://…\")"
            ),
        }
    }

    /// What the PostgreSQL lanes live in: this store's database. Refused,
    /// saying why, on another engine.
    pub fn lanes_engine(&self) -> anyhow::Result<&postgres::PgDb> {
        match self {
            Db::Postgres(pg) => Ok(pg),
            Db::Sqlite(_) => anyhow::bail!(
                "queue.backend = \"postgres\" needs a PostgreSQL store (storage.url = \"postgres://…\")"
            ),
        }
    }

    /// The SQLite handles, when the store is a SQLite file (for the
    /// store's own code and tests that look inside it).
    pub fn sqlite(&self) -> Option<&SqliteDb> {
        match self {
            Db::Sqlite(db) => Some(db),
            Db::Postgres(_) => None,
        }
    }

    /// The PostgreSQL handle, when the store is a PostgreSQL database (for
    /// the store's own code and tests that look inside it).
    pub fn postgres(&self) -> Option<&postgres::PgDb> {
        match self {
            Db::Sqlite(_) => None,
            Db::Postgres(db) => Some(db),
        }
    }

    /// Whether several instances may share this store (PostgreSQL); a
    /// SQLite file belongs to one. For tests; the service asks the topic
    /// that cares (e.g. [`RegistryStore::changed_elsewhere`]).
    pub fn is_shared(&self) -> bool {
        matches!(self, Db::Postgres(_))
    }

    /// `sqlite` or `postgres`, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Db::Sqlite(_) => "sqlite",
            Db::Postgres(_) => "postgres",
        }
    }

    /// True when the store answers a trivial query.
    pub async fn ping(&self) -> bool {
        match self {
            Db::Sqlite(db) => db.ping().await,
            Db::Postgres(db) => db.ping().await,
        }
    }

    pub async fn close(&self) {
        match self {
            Db::Sqlite(db) => db.close().await,
            Db::Postgres(db) => db.close().await,
        }
    }
}

/// Raw SQL for tests that read or arrange a store from outside, on either
/// backend (the SQL must suit both).
#[cfg(test)]
impl Db {
    /// Runs the statements of `sql`, in one transaction.
    pub(crate) async fn test_execute(&self, sql: &str) {
        match self {
            Db::Sqlite(db) => {
                let sql = sql.to_owned();
                db.transact(move |tx| Ok(tx.execute_batch(&sql)?))
                    .await
                    .unwrap()
            }
            Db::Postgres(db) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(&db.pool)
                    .await
                    .unwrap();
            }
        }
    }

    /// The first column of the first row of `sql`, a number.
    pub(crate) async fn test_count(&self, sql: &str) -> i64 {
        match self {
            Db::Sqlite(db) => db
                .row(sql.to_owned(), vec![], sqlite::tuple)
                .await
                .unwrap()
                .map(|(n,)| n)
                .unwrap(),
            Db::Postgres(db) => sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
                .fetch_one(&db.pool)
                .await
                .unwrap(),
        }
    }

    /// Every row of `sql`, whose columns are text (or NULL).
    pub(crate) async fn test_texts(&self, sql: &str) -> Vec<Vec<Option<String>>> {
        match self {
            Db::Sqlite(db) => {
                let sql = sql.to_owned();
                db.read(move |conn| {
                    let mut statement = conn.prepare(&sql)?;
                    let width = statement.column_count();
                    statement
                        .query_map([], |row| {
                            (0..width)
                                .map(|i| {
                                    use rusqlite::types::ValueRef;
                                    Ok(match row.get_ref(i)? {
                                        ValueRef::Null => None,
                                        ValueRef::Integer(n) => Some(n.to_string()),
                                        ValueRef::Real(x) => Some(x.to_string()),
                                        ValueRef::Text(t) | ValueRef::Blob(t) => {
                                            Some(String::from_utf8_lossy(t).into_owned())
                                        }
                                    })
                                })
                                .collect()
                        })?
                        .collect()
                })
                .await
                .unwrap()
            }
            Db::Postgres(db) => {
                use sqlx::Row;
                sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                    .fetch_all(&db.pool)
                    .await
                    .unwrap()
                    .iter()
                    .map(|row| (0..row.len()).map(|i| row.get(i)).collect())
                    .collect()
            }
        }
    }
}
