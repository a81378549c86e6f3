//! Named admins and the audit log on SQLite.

use async_trait::async_trait;
use rusqlite::types::Value;

use super::{SqliteDb, args};
use crate::store::admins::{AdminRow, AdminStore, AuditQuery, AuditRow, AuditValue, NewAdmin};
use crate::store::{StoreError, StoreResult};

const ADMIN_COLUMNS: &str = "id, name, role, created_at, revoked_at";

const AUDIT_COLUMNS: &str = "id, at, actor_id, actor_name, actor_role, action, target, status, \
     state_before, state_after";

/// An [`AdminRow`] from a row of [`ADMIN_COLUMNS`].
fn admin_row(row: &rusqlite::Row) -> rusqlite::Result<AdminRow> {
    Ok(AdminRow {
        id: row.get(0)?,
        name: row.get(1)?,
        role: row.get(2)?,
        created_at: row.get(3)?,
        revoked_at: row.get(4)?,
    })
}

/// An [`AuditRow`] from a row of [`AUDIT_COLUMNS`].
fn audit_row(row: &rusqlite::Row) -> rusqlite::Result<AuditRow> {
    Ok(AuditRow {
        id: row.get(0)?,
        at: row.get(1)?,
        actor_id: row.get(2)?,
        actor_name: row.get(3)?,
        actor_role: row.get(4)?,
        action: row.get(5)?,
        target: row.get(6)?,
        status: row.get(7)?,
        before: row.get(8)?,
        after: row.get(9)?,
    })
}

/// Whether `err` is a broken UNIQUE constraint.
fn is_unique_violation(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<rusqlite::Error>(),
            Some(rusqlite::Error::SqliteFailure(failure, _))
                if failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
        )
    })
}

#[async_trait]
impl AdminStore for SqliteDb {
    async fn insert_admin(&self, admin: &NewAdmin) -> StoreResult<()> {
        const INSERT: &str = "INSERT INTO admins (id, name, role, token_sha256, created_at) \
             VALUES (?1, ?2, ?3, ?4, ?5)";
        let args = args![
            admin.id.clone(),
            admin.name.clone(),
            admin.role.clone(),
            admin.token_sha256.clone(),
            admin.created_at,
        ];
        match self.execute(INSERT, args).await {
            Ok(_) => Ok(()),
            Err(err) if is_unique_violation(&err) => Err(StoreError::Conflict(format!(
                "An active admin is already named {:?}.",
                admin.name
            ))),
            Err(err) => Err(err.into()),
        }
    }

    async fn admin_by_token(&self, token_sha256: &str) -> StoreResult<Option<AdminRow>> {
        let sql = format!(
            "SELECT {ADMIN_COLUMNS} FROM admins WHERE token_sha256 = ?1 AND revoked_at IS NULL"
        );
        Ok(self
            .row(sql, args![token_sha256.to_owned()], admin_row)
            .await?)
    }

    async fn admins(&self) -> StoreResult<Vec<AdminRow>> {
        let sql = format!("SELECT {ADMIN_COLUMNS} FROM admins ORDER BY created_at, id");
        Ok(self.rows(sql, args![], admin_row).await?)
    }

    async fn revoke_admin(&self, id: &str, at: i64) -> StoreResult<Option<AdminRow>> {
        let sql = format!(
            "UPDATE admins SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL \
             RETURNING {ADMIN_COLUMNS}"
        );
        let id = id.to_owned();
        Ok(self
            .transact(move |tx| {
                use rusqlite::OptionalExtension;
                Ok(tx
                    .prepare_cached(&sql)?
                    .query_row(rusqlite::params![id, at], admin_row)
                    .optional()?)
            })
            .await?)
    }

    async fn record_audit(&self, entry: &AuditRow) -> StoreResult<i64> {
        const INSERT: &str = "INSERT INTO audit_log (at, actor_id, actor_name, actor_role, \
             action, target, status, state_before, state_after) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9) RETURNING id";
        let entry = entry.clone();
        Ok(self
            .transact(move |tx| {
                Ok(tx.prepare_cached(INSERT)?.query_row(
                    rusqlite::params![
                        entry.at,
                        entry.actor_id,
                        entry.actor_name,
                        entry.actor_role,
                        entry.action,
                        entry.target,
                        entry.status,
                        entry.before,
                        entry.after,
                    ],
                    |row| row.get(0),
                )?)
            })
            .await?)
    }

    async fn audit_page(&self, query: &AuditQuery) -> StoreResult<Vec<AuditRow>> {
        let (clause, values) = query.where_clause(|n| format!("?{n}"));
        let limit = values.len() + 1;
        let sql = format!(
            "SELECT {AUDIT_COLUMNS} FROM audit_log{clause} ORDER BY id DESC LIMIT ?{limit}"
        );
        let mut args: Vec<Value> = values
            .into_iter()
            .map(|value| match value {
                AuditValue::Text(text) | AuditValue::Prefix(text) => Value::from(text),
                AuditValue::Int(int) => Value::from(int),
            })
            .collect();
        args.push(Value::from(i64::from(query.limit)));
        Ok(self.rows(sql, args, audit_row).await?)
    }

    async fn prune_audit(&self, before: i64) -> StoreResult<u64> {
        const PRUNE: &str = "DELETE FROM audit_log WHERE at < ?1";
        Ok(self.execute(PRUNE, args![before]).await? as u64)
    }

    async fn start_console_session(
        &self,
        id: &str,
        token_sha256: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<()> {
        let (id, hash) = (id.to_owned(), token_sha256.to_owned());
        Ok(self
            .transact(move |tx| {
                tx.execute(
                    "DELETE FROM console_sessions WHERE expires_at <= ?1",
                    rusqlite::params![now],
                )?;
                tx.execute(
                    "INSERT INTO console_sessions (id, token_sha256, created_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4)",
                    rusqlite::params![id, hash, now, expires_at],
                )?;
                Ok(())
            })
            .await?)
    }

    async fn console_session(&self, id: &str, now: i64) -> StoreResult<Option<String>> {
        const LIVE: &str =
            "SELECT token_sha256 FROM console_sessions WHERE id = ?1 AND expires_at > ?2";
        Ok(self
            .row(LIVE, args![id.to_owned(), now], |row| row.get(0))
            .await?)
    }

    async fn end_console_session(&self, id: &str) -> StoreResult<()> {
        self.execute(
            "DELETE FROM console_sessions WHERE id = ?1",
            args![id.to_owned()],
        )
        .await?;
        Ok(())
    }

    async fn end_console_sessions_of(&self, token_sha256: &str) -> StoreResult<u64> {
        Ok(self
            .execute(
                "DELETE FROM console_sessions WHERE token_sha256 = ?1",
                args![token_sha256.to_owned()],
            )
            .await? as u64)
    }
}
