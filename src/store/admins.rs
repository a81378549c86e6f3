//! Named admins and the audit log: who may use the admin API beside the
//! root token, and every change an admin made.

use async_trait::async_trait;

use crate::store::StoreResult;

/// A named admin as stored (its token only as a hash).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminRow {
    pub id: String,
    pub name: String,
    /// `viewer`, `operator` or `owner`.
    pub role: String,
    pub created_at: i64,
    pub revoked_at: Option<i64>,
}

/// An admin to store, with the hex SHA-256 of its token.
#[derive(Debug, Clone)]
pub struct NewAdmin {
    pub id: String,
    pub name: String,
    pub role: String,
    pub token_sha256: String,
    pub created_at: i64,
}

/// One change in the audit log. `id` is given by the store.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRow {
    pub id: i64,
    /// Unix milliseconds.
    pub at: i64,
    pub actor_id: String,
    pub actor_name: String,
    pub actor_role: String,
    /// The method and route, e.g. `PATCH /v1/admin/tenants/{id}`.
    pub action: String,
    /// The path the change was made on, e.g. `/v1/admin/tenants/acme`.
    pub target: String,
    /// The HTTP status of the answer.
    pub status: i64,
    /// JSON, secrets removed.
    pub before: Option<String>,
    pub after: Option<String>,
}

/// Which audit entries to read: newest first, below `before_id` when set.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub actor: Option<String>,
    /// Entries whose action starts with this (`POST`, `DELETE /v1/admin/tenants`).
    pub action: Option<String>,
    /// Entries whose target starts with this (`/v1/admin/tenants/acme`).
    pub target: Option<String>,
    /// Unix milliseconds, inclusive.
    pub since: Option<i64>,
    /// Unix milliseconds, exclusive.
    pub until: Option<i64>,
    pub before_id: Option<i64>,
    pub limit: u32,
}

impl AuditQuery {
    /// The filter as `(condition, value)` pairs in a fixed order, for both
    /// backends to bind: each engine writes its own placeholders.
    pub fn conditions(&self) -> Vec<(&'static str, AuditValue)> {
        let mut conditions = Vec::new();
        if let Some(actor) = &self.actor {
            conditions.push(("actor_name = ", AuditValue::Text(actor.clone())));
        }
        if let Some(action) = &self.action {
            conditions.push((
                "substr(action, 1, length(",
                AuditValue::Prefix(action.clone()),
            ));
        }
        if let Some(target) = &self.target {
            conditions.push((
                "substr(target, 1, length(",
                AuditValue::Prefix(target.clone()),
            ));
        }
        if let Some(since) = self.since {
            conditions.push(("at >= ", AuditValue::Int(since)));
        }
        if let Some(until) = self.until {
            conditions.push(("at < ", AuditValue::Int(until)));
        }
        if let Some(id) = self.before_id {
            conditions.push(("id < ", AuditValue::Int(id)));
        }
        conditions
    }

    /// The `WHERE` clause of [`AuditQuery::conditions`], each value taking
    /// the placeholder `placeholder(n)` gives (1-based).
    pub fn where_clause(&self, placeholder: fn(usize) -> String) -> (String, Vec<AuditValue>) {
        let mut clause = String::new();
        let mut values = Vec::new();
        for (at, (head, value)) in self.conditions().into_iter().enumerate() {
            clause.push_str(if at == 0 { " WHERE " } else { " AND " });
            let mark = placeholder(at + 1);
            match value {
                // A prefix compares the column's first characters with the
                // value: no LIKE, so `%` and `_` in it are plain characters.
                AuditValue::Prefix(_) => {
                    clause.push_str(&format!("{head}{mark})) = {mark}"));
                }
                _ => clause.push_str(&format!("{head}{mark}")),
            }
            values.push(value);
        }
        (clause, values)
    }
}

/// A value an audit filter binds.
#[derive(Debug, Clone)]
pub enum AuditValue {
    Text(String),
    Prefix(String),
    Int(i64),
}

/// Named admins and the audit log, on either backend.
#[async_trait]
pub trait AdminStore: Send + Sync {
    /// Stores a new admin; `Conflict` when an active admin has its name.
    async fn insert_admin(&self, admin: &NewAdmin) -> StoreResult<()>;

    /// The active admin whose token hashes to `token_sha256`.
    async fn admin_by_token(&self, token_sha256: &str) -> StoreResult<Option<AdminRow>>;

    /// Every admin, revoked ones included, oldest first.
    async fn admins(&self) -> StoreResult<Vec<AdminRow>>;

    /// Revokes an active admin: the revoked row, or `None` when there is
    /// no active admin `id`.
    async fn revoke_admin(&self, id: &str, at: i64) -> StoreResult<Option<AdminRow>>;

    /// Appends a change to the audit log; its id.
    async fn record_audit(&self, entry: &AuditRow) -> StoreResult<i64>;

    /// A page of the audit log, newest first.
    async fn audit_page(&self, query: &AuditQuery) -> StoreResult<Vec<AuditRow>>;

    /// Removes the audit entries older than `before` (Unix ms); how many.
    async fn prune_audit(&self, before: i64) -> StoreResult<u64>;

    /// Starts console session `id` for the admin token hashed to
    /// `token_sha256`, ending at `expires_at` (Unix ms); sessions that
    /// ended by `now` are deleted on the way.
    async fn start_console_session(
        &self,
        id: &str,
        token_sha256: &str,
        now: i64,
        expires_at: i64,
    ) -> StoreResult<()>;

    /// The token hash of console session `id` if it has not ended by `now`.
    async fn console_session(&self, id: &str, now: i64) -> StoreResult<Option<String>>;

    /// Ends console session `id` (sign-out).
    async fn end_console_session(&self, id: &str) -> StoreResult<()>;

    /// Ends every console session of the token hashed to `token_sha256`
    /// (the root token rotated); how many there were.
    async fn end_console_sessions_of(&self, token_sha256: &str) -> StoreResult<u64>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_binds_its_filters_in_order_and_compares_prefixes_without_like() {
        let query = AuditQuery {
            actor: Some("desk".into()),
            target: Some("/v1/admin/tenants/a_%".into()),
            before_id: Some(9),
            limit: 10,
            ..AuditQuery::default()
        };
        let (clause, values) = query.where_clause(|n| format!("${n}"));
        assert_eq!(
            clause,
            " WHERE actor_name = $1 AND substr(target, 1, length($2)) = $2 AND id < $3"
        );
        assert_eq!(values.len(), 3);
        assert!(
            AuditQuery::default()
                .where_clause(|n| format!("?{n}"))
                .0
                .is_empty()
        );
    }
}
