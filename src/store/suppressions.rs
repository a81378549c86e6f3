//! Each tenant's suppression list: addresses it must not send to. A hard
//! bounce or a complaint adds one ([`crate::receipts`]); the tenant or an
//! admin adds and removes them through the API; the consumer checks it
//! before every provider call. Addresses are kept normalised, so
//! `Alice@Example.com` and `alice@example.com` are one entry.

use serde::Serialize;
use utoipa::ToSchema;

use crate::message::{MAX_EMAIL_LEN, is_e164, is_email_address};
use crate::model::{Channel, ms_to_rfc3339, now_ms};
use crate::store::{Db, sqlite};

/// The address as stored and compared: an email address in lower case, or
/// an E.164 number; None when it is neither.
pub fn normalize(address: &str) -> Option<(Channel, String)> {
    let address = address.trim();
    if is_e164(address) {
        return Some((Channel::Sms, address.to_owned()));
    }
    let lower = address.to_lowercase();
    (lower.len() <= MAX_EMAIL_LEN && is_email_address(&lower)).then_some((Channel::Email, lower))
}

/// Why an address is on the list.
pub const REASONS: &[&str] = &["bounce", "complaint", "manual", "unsubscribe"];

/// One entry of a tenant's list.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Suppression {
    /// Normalised: lower-case email address or E.164 number.
    pub address: String,
    /// `email` or `sms`.
    pub channel: String,
    /// `bounce`, `complaint`, `manual` or `unsubscribe` (one-click).
    pub reason: String,
    /// The provider's words (bounce type, error code) or the caller's note.
    pub detail: Option<String>,
    /// The message whose receipt added it, for bounces and complaints.
    pub message_id: Option<String>,
    /// RFC 3339.
    #[sqlx(skip)]
    pub created_at: String,
    #[serde(skip)]
    #[sqlx(rename = "created_at")]
    pub created_ms: i64,
}

impl Suppression {
    fn dated(mut self) -> Self {
        self.created_at = ms_to_rfc3339(self.created_ms);
        self
    }
}

/// Adds `address` (normalised) unless it is already listed, in the
/// caller's transaction; the first reason stays.
pub const INSERT: &str = "INSERT INTO suppressions (tenant_id, address, channel, reason, detail, message_id, created_at) \
     VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (tenant_id, address) DO NOTHING";

/// Adds `address` to `tenant_id`'s list with reason `unsubscribe` (a
/// one-click unsubscribe from message `message_id`) and, when it was not
/// listed before, records the `unsubscribed` event on that message (with
/// its `message.unsubscribed` webhook call); one transaction. The message
/// may be gone (its tenant's data erased): the address is listed all the
/// same. True when it was added.
pub async fn unsubscribe(
    db: &Db,
    tenant_id: &str,
    channel: Channel,
    address: &str,
    message_id: &str,
    now: i64,
) -> anyhow::Result<bool> {
    match db {
        Db::Sqlite(sqlite) => {
            let (tenant_id, address, message_id) = (
                tenant_id.to_owned(),
                address.to_owned(),
                message_id.to_owned(),
            );
            sqlite
                .transact(move |tx| {
                    let added = tx.prepare_cached(INSERT)?.execute(rusqlite::params![
                        tenant_id,
                        address,
                        channel.as_str(),
                        "unsubscribe",
                        None::<String>,
                        message_id,
                        now
                    ])? > 0;
                    if added {
                        super::sqlite::lifecycle::note(
                            tx,
                            &message_id,
                            &tenant_id,
                            "unsubscribed",
                            now,
                        )?;
                    }
                    Ok(added)
                })
                .await
        }
        Db::Postgres(pg) => {
            let mut tx = pg.pool.begin().await?;
            let added = sqlx::query(INSERT)
                .bind(tenant_id)
                .bind(address)
                .bind(channel.as_str())
                .bind("unsubscribe")
                .bind(None::<String>)
                .bind(message_id)
                .bind(now)
                .execute(&mut *tx)
                .await?
                .rows_affected()
                > 0;
            if added {
                super::postgres::lifecycle::note(
                    &mut tx,
                    message_id,
                    tenant_id,
                    "unsubscribed",
                    now,
                )
                .await?;
            }
            tx.commit().await?;
            Ok(added)
        }
    }
}

/// Adds an entry by hand; true when it was not listed before.
pub async fn add(
    db: &Db,
    tenant_id: &str,
    channel: Channel,
    address: &str,
    detail: Option<&str>,
) -> anyhow::Result<bool> {
    let added = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![
                tenant_id.to_owned(),
                address.to_owned(),
                channel.as_str().to_owned(),
                "manual".to_owned(),
                detail.map(str::to_owned),
                None::<String>,
                now_ms()
            ];
            db.execute(INSERT, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(INSERT)
            .bind(tenant_id)
            .bind(address)
            .bind(channel.as_str())
            .bind("manual")
            .bind(detail)
            .bind(None::<String>)
            .bind(now_ms())
            .execute(&db.pool)
            .await?
            .rows_affected(),
    };
    Ok(added == 1)
}

const COLUMNS: &str = "address, channel, reason, detail, message_id, created_at";

/// A [`Suppression`] from a rusqlite row of [`COLUMNS`].
fn suppression_row(row: &rusqlite::Row) -> rusqlite::Result<Suppression> {
    Ok(Suppression {
        address: row.get(0)?,
        channel: row.get(1)?,
        reason: row.get(2)?,
        detail: row.get(3)?,
        message_id: row.get(4)?,
        created_at: String::new(),
        created_ms: row.get(5)?,
    })
}

/// One entry, if listed.
pub async fn get(db: &Db, tenant_id: &str, address: &str) -> anyhow::Result<Option<Suppression>> {
    let sql = format!("SELECT {COLUMNS} FROM suppressions WHERE tenant_id = $1 AND address = $2");
    let row = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), address.to_owned()];
            db.row(sql, args, suppression_row).await?
        }
        Db::Postgres(db) => {
            sqlx::query_as::<_, Suppression>(sqlx::AssertSqlSafe(sql))
                .bind(tenant_id)
                .bind(address)
                .fetch_optional(&db.pool)
                .await?
        }
    };
    Ok(row.map(Suppression::dated))
}

/// True when `address` (normalised) is on the tenant's list.
pub async fn contains(db: &Db, tenant_id: &str, address: &str) -> anyhow::Result<bool> {
    const LISTED: &str = "SELECT 1 FROM suppressions WHERE tenant_id = $1 AND address = $2";
    Ok(match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), address.to_owned()];
            db.row(LISTED, args, |_| Ok(())).await?.is_some()
        }
        Db::Postgres(db) => sqlx::query_scalar::<_, i32>(LISTED)
            .bind(tenant_id)
            .bind(address)
            .fetch_optional(&db.pool)
            .await?
            .is_some(),
    })
}

/// Up to `limit` entries after `after` (an address; None from the start),
/// in address order.
pub async fn list(
    db: &Db,
    tenant_id: &str,
    after: Option<&str>,
    limit: i64,
) -> anyhow::Result<Vec<Suppression>> {
    let sql = format!(
        "SELECT {COLUMNS} FROM suppressions \
         WHERE tenant_id = $1 AND address > $2 ORDER BY address LIMIT $3"
    );
    let after = after.unwrap_or("");
    let rows = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), after.to_owned(), limit];
            db.rows(sql, args, suppression_row).await?
        }
        Db::Postgres(db) => {
            sqlx::query_as::<_, Suppression>(sqlx::AssertSqlSafe(sql))
                .bind(tenant_id)
                .bind(after)
                .bind(limit)
                .fetch_all(&db.pool)
                .await?
        }
    };
    Ok(rows.into_iter().map(Suppression::dated).collect())
}

/// Removes an entry; true when it was listed.
pub async fn remove(db: &Db, tenant_id: &str, address: &str) -> anyhow::Result<bool> {
    const REMOVE: &str = "DELETE FROM suppressions WHERE tenant_id = $1 AND address = $2";
    let removed = match db {
        Db::Sqlite(db) => {
            let args = sqlite::args![tenant_id.to_owned(), address.to_owned()];
            db.execute(REMOVE, args).await? as u64
        }
        Db::Postgres(db) => sqlx::query(REMOVE)
            .bind(tenant_id)
            .bind(address)
            .execute(&db.pool)
            .await?
            .rows_affected(),
    };
    Ok(removed == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_normalised_so_case_does_not_make_a_second_entry() {
        assert_eq!(
            normalize(" Alice@Example.COM "),
            Some((Channel::Email, "alice@example.com".into()))
        );
        assert_eq!(
            normalize("+15551234567"),
            Some((Channel::Sms, "+15551234567".into()))
        );
        assert_eq!(normalize("not an address"), None);
        assert_eq!(normalize("5551234567"), None);
    }
}

/// (Being moved here: the suppressions operations, implemented per engine in
/// `sqlite/suppressions.rs` and `postgres/suppressions.rs`.)
#[async_trait::async_trait]
pub trait SuppressionStore: Send + Sync {}
