//! Named admins and the audit log on PostgreSQL.

use async_trait::async_trait;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::PgDb;
use crate::store::admins::{AdminRow, AdminStore, AuditQuery, AuditRow, AuditValue, NewAdmin};
use crate::store::{StoreError, StoreResult};

const ADMIN_COLUMNS: &str = "id, name, role, created_at, revoked_at";

const AUDIT_COLUMNS: &str = "id, at, actor_id, actor_name, actor_role, action, target, status, \
     state_before, state_after";

/// An [`AdminRow`] from a row of [`ADMIN_COLUMNS`].
fn admin_row(row: &PgRow) -> Result<AdminRow, sqlx::Error> {
    Ok(AdminRow {
        id: row.try_get(0)?,
        name: row.try_get(1)?,
        role: row.try_get(2)?,
        created_at: row.try_get(3)?,
        revoked_at: row.try_get(4)?,
    })
}

/// An [`AuditRow`] from a row of [`AUDIT_COLUMNS`].
fn audit_row(row: &PgRow) -> Result<AuditRow, sqlx::Error> {
    Ok(AuditRow {
        id: row.try_get(0)?,
        at: row.try_get(1)?,
        actor_id: row.try_get(2)?,
        actor_name: row.try_get(3)?,
        actor_role: row.try_get(4)?,
        action: row.try_get(5)?,
        target: row.try_get(6)?,
        status: i64::from(row.try_get::<i32, _>(7)?),
        before: row.try_get(8)?,
        after: row.try_get(9)?,
    })
}

#[async_trait]
impl AdminStore for PgDb {
    async fn insert_admin(&self, admin: &NewAdmin) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO admins (id, name, role, token_sha256, created_at) \
             VALUES ($1, $2, $3, $4, $5)";
        let inserted = sqlx::query(INSERT)
            .bind(&admin.id)
            .bind(&admin.name)
            .bind(&admin.role)
            .bind(&admin.token_sha256)
            .bind(admin.created_at)
            .execute(&self.pool)
            .await;
        match inserted {
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(err)) if err.is_unique_violation() => {
                Err(StoreError::Conflict(format!(
                    "An active admin is already named {:?}.",
                    admin.name
                )))
            }
            Err(err) => Err(err.into()),
        }
    }

    async fn admin_by_token(&self, token_sha256: &str) -> StoreResult<Option<AdminRow>> {
        let sql = format!(
            "SELECT {ADMIN_COLUMNS} FROM admins WHERE token_sha256 = $1 AND revoked_at IS NULL"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(token_sha256)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(admin_row).transpose()?)
    }

    async fn admins(&self) -> StoreResult<Vec<AdminRow>> {
        let sql = format!("SELECT {ADMIN_COLUMNS} FROM admins ORDER BY created_at, id");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(admin_row).collect::<Result<_, _>>()?)
    }

    async fn revoke_admin(&self, id: &str, at: i64) -> StoreResult<Option<AdminRow>> {
        let sql = format!(
            "UPDATE admins SET revoked_at = $2 WHERE id = $1 AND revoked_at IS NULL \
             RETURNING {ADMIN_COLUMNS}"
        );
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .bind(at)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.as_ref().map(admin_row).transpose()?)
    }

    async fn record_audit(&self, entry: &AuditRow) -> StoreResult<i64> {
        const INSERT: &str = "INSERT INTO audit_log (at, actor_id, actor_name, actor_role, \
             action, target, status, state_before, state_after) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id";
        Ok(sqlx::query_scalar(INSERT)
            .bind(entry.at)
            .bind(&entry.actor_id)
            .bind(&entry.actor_name)
            .bind(&entry.actor_role)
            .bind(&entry.action)
            .bind(&entry.target)
            .bind(i32::try_from(entry.status).unwrap_or(i32::MAX))
            .bind(&entry.before)
            .bind(&entry.after)
            .fetch_one(&self.pool)
            .await?)
    }

    async fn audit_page(&self, query: &AuditQuery) -> StoreResult<Vec<AuditRow>> {
        let (clause, values) = query.where_clause(|n| format!("${n}"));
        let limit = values.len() + 1;
        let sql = format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_log{clause} ORDER BY id DESC LIMIT ${limit}"
        );
        let mut statement = sqlx::query(sqlx::AssertSqlSafe(sql));
        for value in values {
            statement = match value {
                AuditValue::Text(text) | AuditValue::Prefix(text) => statement.bind(text),
                AuditValue::Int(int) => statement.bind(int),
            };
        }
        let rows = statement
            .bind(i64::from(query.limit))
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(audit_row).collect::<Result<_, _>>()?)
    }

    async fn prune_audit(&self, before: i64) -> StoreResult<u64> {
        let done = sqlx::query("DELETE FROM audit_log WHERE at < $1")
            .bind(before)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }

    async fn start_console_session(
        &self,
        id: &str,
        token_sha256: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<()> {
        let mut tx = self.pool.begin().await?;
        sqlx::query("DELETE FROM console_sessions WHERE expires_at <= $1")
            .bind(now)
            .execute(&mut *tx)
            .await?;
        sqlx::query(
            "INSERT INTO console_sessions (id, token_sha256, created_at, expires_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(id)
        .bind(token_sha256)
        .bind(now)
        .bind(expires_at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn console_session(&self, id: &str, now: i64) -> StoreResult<Option<String>> {
        const LIVE: &str =
            "SELECT token_sha256 FROM console_sessions WHERE id = $1 AND expires_at > $2";
        Ok(sqlx::query_scalar(LIVE)
            .bind(id)
            .bind(now)
            .fetch_optional(&self.pool)
            .await?)
    }

    async fn end_console_session(&self, id: &str) -> StoreResult<()> {
        sqlx::query("DELETE FROM console_sessions WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn end_console_sessions_of(&self, token_sha256: &str) -> StoreResult<u64> {
        let done = sqlx::query("DELETE FROM console_sessions WHERE token_sha256 = $1")
            .bind(token_sha256)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
