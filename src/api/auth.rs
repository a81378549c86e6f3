//! Authentication: tenant API keys on `/v1/messages*`, the admin bearer
//! token on `/v1/admin/*`. Both are checked against SHA-256 hashes held in
//! memory; no secret is stored in clear.

use std::sync::PoisonError;

use axum::extract::FromRequestParts;
use axum::http::Method;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use secrecy::ExposeSecret;
use tracing::{info, warn};

use crate::api::AppState;
use crate::api::error::{ApiError, LimitReason};
use crate::config::Settings;
use crate::model::TenantStatus;
use crate::store::Db;
use crate::tenants::{Caller, hash_secret, random_hex};

/// Settings-table key of the generated admin token's hash.
const ADMIN_HASH_KEY: &str = "admin_token_sha256";

/// Prefix of generated admin tokens.
pub const ADMIN_TOKEN_PREFIX: &str = "fla_";

/// How often an instance whose root token is the stored one looks for a
/// rotation (`fairlane admin-token --rotate` run beside it).
pub const ROTATION_CHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// The root admin token's hash. Clones share it, so a rotation noticed by
/// [`AdminAuth::follow_rotations`] reaches every request at once.
#[derive(Debug, Clone)]
pub struct AdminAuth {
    hash: std::sync::Arc<std::sync::RwLock<[u8; 32]>>,
    /// The hash is the store's (no `server.admin_token`): rotations apply.
    stored: bool,
}

impl AdminAuth {
    /// Uses `server.admin_token` when set; otherwise the hash stored by an
    /// earlier start; otherwise generates a token, logs it once and stores
    /// only its hash.
    pub async fn init(db: &Db, settings: &Settings) -> anyhow::Result<Self> {
        if let Some(token) = &settings.server.admin_token {
            anyhow::ensure!(
                token.expose_secret().len() >= 16,
                "server.admin_token must be at least 16 characters"
            );
            return Ok(AdminAuth {
                hash: std::sync::Arc::new(hash_secret(token.expose_secret()).into()),
                stored: false,
            });
        }
        if db.setting(ADMIN_HASH_KEY).await?.is_none() {
            let token = Self::rotate(db).await?;
            warn!(
                admin_token = %token,
                "Generated an admin token because server.admin_token is not set. It is shown only this once; \
                 keep it, or set FAIRLANE__SERVER__ADMIN_TOKEN, or run `fairlane admin-token --rotate`."
            );
        }
        let hash = stored_hash(db)
            .await?
            .ok_or_else(|| anyhow::anyhow!("admin token hash missing"))?;
        Ok(AdminAuth {
            hash: std::sync::Arc::new(hash.into()),
            stored: true,
        })
    }

    /// Generates a new admin token, stores its hash and returns it. The
    /// old token's console sessions end here; running instances stop
    /// taking the old token within [`ROTATION_CHECK`].
    pub async fn rotate(db: &Db) -> anyhow::Result<String> {
        let old = db.setting(ADMIN_HASH_KEY).await?;
        let token = format!("{ADMIN_TOKEN_PREFIX}{}", random_hex(32));
        db.set_setting(ADMIN_HASH_KEY, &hex::encode(hash_secret(&token)))
            .await?;
        if let Some(old) = old {
            db.end_console_sessions_of(old.trim()).await?;
        }
        Ok(token)
    }

    fn current(&self) -> [u8; 32] {
        *self.hash.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn matches(&self, token: &str) -> bool {
        hash_secret(token) == self.current()
    }

    /// Until `shutdown`: every [`ROTATION_CHECK`], takes a root token hash
    /// the store holds that differs from this instance's (a rotation made
    /// beside the running instance). Nothing to follow when the token is
    /// `server.admin_token`.
    pub async fn follow_rotations(self, db: Db, mut shutdown: tokio::sync::watch::Receiver<bool>) {
        if !self.stored {
            return;
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(ROTATION_CHECK) => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            match stored_hash(&db).await {
                Ok(Some(hash)) if hash != self.current() => {
                    *self.hash.write().unwrap_or_else(PoisonError::into_inner) = hash;
                    info!("The admin token was rotated; the old one is refused from now on.");
                }
                Ok(_) => {}
                Err(err) => {
                    warn!(error = %err, "Could not look for a rotated admin token; trying again.");
                }
            }
        }
    }
}

/// The root token's hash the store holds, if any.
async fn stored_hash(db: &Db) -> anyhow::Result<Option<[u8; 32]>> {
    let Some(stored) = db.setting(ADMIN_HASH_KEY).await? else {
        return Ok(None);
    };
    let mut hash = [0u8; 32];
    hex::decode_to_slice(stored.trim(), &mut hash)
        .map_err(|e| anyhow::anyhow!("stored admin token hash is not valid hex: {e}"))?;
    Ok(Some(hash))
}

/// The bearer token in `headers`, if there is a well-formed one.
pub(crate) fn bearer_of(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The bearer token of a request, if any.
fn bearer(parts: &Parts) -> Result<&str, ApiError> {
    let value = parts.headers.get(AUTHORIZATION).ok_or_else(|| {
        ApiError::Unauthorized(
            "Missing Authorization header; send `Authorization: Bearer <key>`.".into(),
        )
    })?;
    let value = value
        .to_str()
        .map_err(|_| ApiError::Unauthorized("Authorization header is not valid text.".into()))?;
    let (scheme, token) = value.split_once(' ').ok_or_else(|| {
        ApiError::Unauthorized("Authorization header must be `Bearer <key>`.".into())
    })?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(ApiError::Unauthorized(
            "Authorization header must be `Bearer <key>`.".into(),
        ));
    }
    Ok(token.trim())
}

/// A request authenticated with a tenant API key.
pub struct TenantAuth(pub Caller);

impl FromRequestParts<AppState> for TenantAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(parts)?;
        if let Some(caller) = state.registry.authenticate(token) {
            return Ok(TenantAuth(caller));
        }
        if state.admin.matches(token) {
            return Err(ApiError::Unauthorized(
                "The admin token cannot be used on tenant routes; use a tenant API key.".into(),
            ));
        }
        Err(ApiError::Unauthorized("Invalid or revoked API key.".into()))
    }
}

/// A tenant's change other than a send (a webhook or suppression change,
/// a cancel): authenticated as [`TenantAuth`], refused 403 for a disabled
/// tenant, and charged to the tenant's bucket of changes (429 when empty;
/// see [`crate::limits::writes`]).
pub struct TenantWrite(pub Caller);

impl FromRequestParts<AppState> for TenantWrite {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let TenantAuth(caller) = TenantAuth::from_request_parts(parts, state).await?;
        admit_change(&caller, state).await?;
        Ok(TenantWrite(caller))
    }
}

/// An upload: authenticated as [`TenantAuth`], refused 403 for a disabled
/// tenant, and charged to the bucket of uploads of the tenant's world at
/// its plan's `uploads_per_minute` (429 `too-many-uploads` when empty; see
/// [`crate::limits::uploads`]), not to the bucket of changes.
pub struct TenantUpload(pub Caller);

impl FromRequestParts<AppState> for TenantUpload {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let TenantAuth(caller) = TenantAuth::from_request_parts(parts, state).await?;
        refuse_disabled(&caller)?;
        let per_minute = caller.plan.uploads_per_minute;
        if let Err(retry_after) = state.uploads.take(&caller.scope(), per_minute).await {
            metrics::counter!(crate::metrics::REJECTED_TOTAL, "reason" => "uploads").increment(1);
            return Err(ApiError::TooManyRequests {
                reason: LimitReason::Uploads,
                detail: format!(
                    "Plan {:?} allows {per_minute} uploads per minute in each world (live and test apart).",
                    caller.plan.name
                ),
                retry_after,
                rate: None,
            });
        }
        Ok(TenantUpload(caller))
    }
}

/// Refuses a disabled tenant's change (403).
fn refuse_disabled(caller: &Caller) -> Result<(), ApiError> {
    if caller.tenant.status == TenantStatus::Disabled {
        return Err(ApiError::Forbidden(format!(
            "Tenant {:?} is disabled; its changes are refused until an admin re-enables it.",
            caller.tenant.id
        )));
    }
    Ok(())
}

/// A change other than a send: refused 403 for a disabled tenant, and
/// charged to the tenant's bucket of changes (429 when empty).
async fn admit_change(caller: &Caller, state: &AppState) -> Result<(), ApiError> {
    refuse_disabled(caller)?;
    if let Err(retry_after) = state.writes.take(&caller.tenant.id).await {
        metrics::counter!(crate::metrics::REJECTED_TOTAL, "reason" => "writes").increment(1);
        return Err(ApiError::TooManyRequests {
            reason: LimitReason::Writes,
            detail: format!(
                "Changes other than sends are limited to {} per second with bursts of {} per tenant.",
                state.settings.limits.tenant_writes_per_second,
                state.settings.limits.tenant_writes_burst
            ),
            retry_after,
            rate: None,
        });
    }
    Ok(())
}

/// A change to a setting both of a tenant's worlds share (its webhook, its
/// suppression list): a [`TenantWrite`] made with a live key. A test key
/// may read these settings but not change them, so a leaked CI key can
/// neither re-point the live webhook nor lift a bounce's suppression.
pub struct LiveWrite(pub Caller);

impl FromRequestParts<AppState> for LiveWrite {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let TenantAuth(caller) = TenantAuth::from_request_parts(parts, state).await?;
        if caller.test {
            return Err(ApiError::Forbidden(
                "A test key cannot change the tenant's webhook or suppression list, which its live messages share; use a live key.".into(),
            ));
        }
        admit_change(&caller, state).await?;
        Ok(LiveWrite(caller))
    }
}

/// What an admin may do: a `viewer` reads the admin API, an `operator`
/// also changes tenants, plans, keys, webhooks, suppressions and queues,
/// and an `owner` also manages the admins. The root token
/// (`server.admin_token`, or the generated one) is an owner.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Viewer,
    Operator,
    Owner,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Owner => "owner",
        }
    }

    pub fn parse(role: &str) -> Option<Role> {
        match role {
            "viewer" => Some(Role::Viewer),
            "operator" => Some(Role::Operator),
            "owner" => Some(Role::Owner),
            _ => None,
        }
    }
}

/// The admin a request was made by, as the audit log names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// `root` for the root token, the admin's id otherwise.
    pub id: String,
    pub name: String,
    pub role: Role,
}

impl Actor {
    fn root() -> Actor {
        Actor {
            id: "root".into(),
            name: "root".into(),
            role: Role::Owner,
        }
    }
}

impl AdminAuth {
    /// The admin `token` belongs to: the root admin, or an active named
    /// admin (looked up in the store on every request, so a revocation
    /// holds at once on every instance); `None` when it is neither.
    pub async fn actor(&self, db: &Db, token: &str) -> Result<Option<Actor>, ApiError> {
        let hash = hash_secret(token);
        if hash != self.current() && !token.starts_with(ADMIN_TOKEN_PREFIX) {
            return Ok(None);
        }
        self.actor_by_hash(db, &hash).await
    }

    /// The admin whose token hashes to `hash` (see [`AdminAuth::actor`]);
    /// the console's session keeps only this hash.
    pub async fn actor_by_hash(&self, db: &Db, hash: &[u8; 32]) -> Result<Option<Actor>, ApiError> {
        if *hash == self.current() {
            return Ok(Some(Actor::root()));
        }
        let Some(row) = db.admin_by_token(&hex::encode(hash)).await? else {
            return Ok(None);
        };
        // A role the store holds and this build does not know reads only.
        let role = Role::parse(&row.role).unwrap_or(Role::Viewer);
        Ok(Some(Actor {
            id: row.id,
            name: row.name,
            role,
        }))
    }
}

/// Where the admin a request was authenticated as is left for the audit
/// log ([`crate::api::audit`]), which puts the slot in the request before
/// the handler runs and reads it once the answer is ready.
#[derive(Clone, Default)]
pub struct ActorSlot(std::sync::Arc<std::sync::OnceLock<Actor>>);

impl ActorSlot {
    pub fn actor(&self) -> Option<&Actor> {
        self.0.get()
    }

    /// Leaves `actor` in the request's slot, if the request has one.
    pub fn fill(parts: &Parts, actor: &Actor) {
        if let Some(slot) = parts.extensions.get::<ActorSlot>() {
            let _ = slot.0.set(actor.clone());
        }
    }
}

/// The admin of a request, whatever its role; [`ApiError`]s for a missing,
/// invalid or tenant's token.
async fn admin_of(parts: &Parts, state: &AppState) -> Result<Actor, ApiError> {
    let token = bearer(parts)?;
    if let Some(actor) = state.admin.actor(&state.db, token).await? {
        ActorSlot::fill(parts, &actor);
        return Ok(actor);
    }
    if state.registry.authenticate(token).is_some() {
        return Err(ApiError::Forbidden(
            "Tenant API keys cannot use admin routes.".into(),
        ));
    }
    Err(ApiError::Unauthorized("Invalid admin token.".into()))
}

/// A request authenticated as an admin. Any role may read (`GET`,
/// `HEAD`); a change needs an operator or an owner, so a viewer's change
/// is refused 403 before the handler runs.
pub struct AdminOnly(pub Actor);

impl FromRequestParts<AppState> for AdminOnly {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let actor = admin_of(parts, state).await?;
        let reads = matches!(parts.method, Method::GET | Method::HEAD);
        if !reads && actor.role < Role::Operator {
            return Err(ApiError::Forbidden(format!(
                "Admin {:?} has the viewer role: it may read the admin API but not change anything.",
                actor.name
            )));
        }
        Ok(AdminOnly(actor))
    }
}

/// A request authenticated as an owner: the admins' own routes.
pub struct OwnerOnly(pub Actor);

impl FromRequestParts<AppState> for OwnerOnly {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let actor = admin_of(parts, state).await?;
        if actor.role < Role::Owner {
            return Err(ApiError::Forbidden(format!(
                "Only an owner may manage admins; {:?} is {} {}.",
                actor.name,
                if actor.role == Role::Operator {
                    "an"
                } else {
                    "a"
                },
                actor.role.as_str()
            )));
        }
        Ok(OwnerOnly(actor))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rotation made beside a running instance (the CLI's) ends the old
    /// token's console sessions at once, and the instance refuses the old
    /// token and takes the new one within [`ROTATION_CHECK`].
    #[tokio::test]
    async fn a_rotation_reaches_a_running_instance_and_ends_the_old_tokens_sessions() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("a.db"), false).await.unwrap();
        let settings = Settings::from_toml_overlay("").unwrap();
        assert!(settings.server.admin_token.is_none());
        let old = AdminAuth::rotate(&db).await.unwrap();
        let running = AdminAuth::init(&db, &settings).await.unwrap();
        assert!(running.matches(&old));
        let old_hash = hex::encode(hash_secret(&old));
        db.start_console_session("s1", &old_hash, 1, i64::MAX)
            .await
            .unwrap();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let following = tokio::spawn(running.clone().follow_rotations(db.clone(), stopped));

        let new = AdminAuth::rotate(&db).await.unwrap();
        assert_eq!(db.console_session("s1", 2).await.unwrap(), None);
        let deadline = tokio::time::Instant::now() + ROTATION_CHECK * 3;
        while running.matches(&old) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(!running.matches(&old), "the old token is refused");
        assert!(running.matches(&new), "the new token is taken");
        stop.send(true).unwrap();
        following.await.unwrap();
    }
}
