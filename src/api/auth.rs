//! Authentication: tenant API keys on `/v1/messages*`, the admin bearer
//! token on `/v1/admin/*`. Both are checked against SHA-256 hashes held in
//! memory; no secret is stored in clear.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use secrecy::ExposeSecret;
use tracing::warn;

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

/// The admin token's hash.
#[derive(Debug, Clone)]
pub struct AdminAuth {
    hash: [u8; 32],
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
                hash: hash_secret(token.expose_secret()),
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
        let stored = db
            .setting(ADMIN_HASH_KEY)
            .await?
            .ok_or_else(|| anyhow::anyhow!("admin token hash missing"))?;
        let mut hash = [0u8; 32];
        hex::decode_to_slice(stored.trim(), &mut hash)
            .map_err(|e| anyhow::anyhow!("stored admin token hash is not valid hex: {e}"))?;
        Ok(AdminAuth { hash })
    }

    /// Generates a new admin token, stores its hash and returns it.
    pub async fn rotate(db: &Db) -> anyhow::Result<String> {
        let token = format!("{ADMIN_TOKEN_PREFIX}{}", random_hex(32));
        db.set_setting(ADMIN_HASH_KEY, &hex::encode(hash_secret(&token)))
            .await?;
        Ok(token)
    }

    pub fn matches(&self, token: &str) -> bool {
        hash_secret(token) == self.hash
    }
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

/// A change other than a send: refused 403 for a disabled tenant, and
/// charged to the tenant's bucket of changes (429 when empty).
async fn admit_change(caller: &Caller, state: &AppState) -> Result<(), ApiError> {
    if caller.tenant.status == TenantStatus::Disabled {
        return Err(ApiError::Forbidden(format!(
            "Tenant {:?} is disabled; its changes are refused until an admin re-enables it.",
            caller.tenant.id
        )));
    }
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

/// A request authenticated with the admin token.
pub struct AdminOnly;

impl FromRequestParts<AppState> for AdminOnly {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(parts)?;
        if state.admin.matches(token) {
            return Ok(AdminOnly);
        }
        if state.registry.authenticate(token).is_some() {
            return Err(ApiError::Forbidden(
                "Tenant API keys cannot use admin routes.".into(),
            ));
        }
        Err(ApiError::Unauthorized("Invalid admin token.".into()))
    }
}
