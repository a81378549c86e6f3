//! Durable state: tenants, plans, API keys, message status and events,
//! idempotency keys, suppressions, webhooks' rows and the SQS outbox. Every
//! statement of the service's own tables lives under this folder; nothing
//! above it writes SQL or asks which database it talks to.
//!
//! Two backends keep it, chosen by `storage.url`: one SQLite file
//! ([`sqlite`], the default, one instance) or a PostgreSQL database
//! ([`postgres`], shared by several instances; the lanes are then SQS
//! queues). [`Db`] is the handle the rest of the service holds; the modules
//! beside it are the operations, in the domain's words. Each operation
//! runs on its backend's one driver: rusqlite on the SQLite file, sqlx on
//! PostgreSQL. Rare SQL both engines take is written once (`$1`
//! parameters, which the SQLite side binds as `?1`, `ON CONFLICT`,
//! `RETURNING`); what differs per engine lives in the backend's folder.
//! The hot writes go through one [`Writer`], which hands them to the
//! backend's group-committing writer.
//!
//! The embedded queue keeps its own tables in the SQLite file and runs its
//! work on the SQLite writer ([`sqlite::writer`]).

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
pub mod sqlite;
mod staging;
mod streak;
pub mod suppressions;
pub mod usage;
mod usage_counters;
pub mod webhooks;

pub use delivery::{
    BeforeSend, Called, CallsRecord, PassRooms, SendCheck, StreamRead, TakenCalls, TenantRoom,
};
pub use error::StoreError;
pub use hot::Writer;
pub use sqlite::SqliteDb;
pub(crate) use staging::group_span;
pub use staging::{AcceptEntry, AfterCommit, NotDurable, QueueRows, Staging};
pub use streak::{FailureStreak, WriteFailed};

use std::path::Path;

pub use crate::config::{is_postgres_url, sqlite_path};

/// The store, on one backend or the other.
#[derive(Clone, Debug)]
pub enum Db {
    Sqlite(SqliteDb),
    Postgres(postgres::PgDb),
}

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

    /// The SQLite handles, when the store is a SQLite file.
    pub fn sqlite(&self) -> Option<&SqliteDb> {
        match self {
            Db::Sqlite(db) => Some(db),
            Db::Postgres(_) => None,
        }
    }

    /// The PostgreSQL handle, when the store is a PostgreSQL database.
    pub fn postgres(&self) -> Option<&postgres::PgDb> {
        match self {
            Db::Sqlite(_) => None,
            Db::Postgres(db) => Some(db),
        }
    }

    /// Whether several instances may share this store (PostgreSQL); a
    /// SQLite file belongs to one.
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

    /// Reads a value from the `settings` table.
    pub async fn setting(&self, key: &str) -> anyhow::Result<Option<String>> {
        const READ: &str = "SELECT value FROM settings WHERE key = $1";
        Ok(match self {
            Db::Sqlite(db) => db
                .row(READ, sqlite::args![key.to_owned()], sqlite::tuple)
                .await?
                .map(|(value,)| value),
            Db::Postgres(db) => {
                sqlx::query_scalar(READ)
                    .bind(key)
                    .fetch_optional(&db.pool)
                    .await?
            }
        })
    }

    /// Writes a value to the `settings` table.
    pub async fn set_setting(&self, key: &str, value: &str) -> anyhow::Result<()> {
        self.write_setting(key, value, "UPDATE SET value = excluded.value")
            .await
    }

    /// The value of `key` in the `settings` table, storing `value` first
    /// when there is none; instances starting together agree on one.
    pub async fn setting_or_insert(&self, key: &str, value: &str) -> anyhow::Result<String> {
        self.write_setting(key, value, "NOTHING").await?;
        self.setting(key)
            .await?
            .ok_or_else(|| anyhow::anyhow!("setting {key} vanished after it was written"))
    }

    /// Inserts `key` = `value`, doing `on_conflict` when it is there.
    async fn write_setting(&self, key: &str, value: &str, on_conflict: &str) -> anyhow::Result<()> {
        let sql = format!(
            "INSERT INTO settings(key, value) VALUES ($1, $2) ON CONFLICT(key) DO {on_conflict}"
        );
        match self {
            Db::Sqlite(db) => {
                db.execute(sql, sqlite::args![key.to_owned(), value.to_owned()])
                    .await?;
            }
            Db::Postgres(db) => {
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(key)
                    .bind(value)
                    .execute(&db.pool)
                    .await?;
            }
        }
        Ok(())
    }

    /// Keeps the query planner's statistics current: SQLite's `PRAGMA
    /// optimize` (an `ANALYZE` of the tables whose size changed enough,
    /// reading a bounded sample); nothing on PostgreSQL, whose autovacuum
    /// analyzes a table after enough of its rows changed.
    pub async fn refresh_statistics(&self) -> anyhow::Result<()> {
        match self {
            Db::Sqlite(db) => db.refresh_statistics().await,
            Db::Postgres(_) => Ok(()),
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
