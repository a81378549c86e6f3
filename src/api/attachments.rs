//! Email attachments over the API: `POST /v1/attachments` streams a file
//! into the store and answers its id, which a send names in
//! `attachments`; `GET /v1/attachments/{attachment_id}` shows a file and
//! how many messages use it; `DELETE` takes it back from new sends. Any
//! key may upload: a test key's files go out only with its test sends, a
//! live key's with live ones. A file serves any number of sends until it
//! expires, a day after its upload. See [`crate::attachments`] for the
//! checks and the limits.

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::auth::{TenantAuth, TenantUpload, TenantWrite};
use super::error::{ApiError, Problem, TenantUnauthorized, TooManyChanges, TooManyUploads};
use super::{ApiPath, AppState, body_too_late};
use crate::attachments::{MAX_FILE_BYTES, Upload, UploadRefused};
use crate::model::{ms_to_rfc3339, now_ms};
use crate::store::attachments::{AttachmentRow, Deleted};

/// The upload route, apart from the others: its body is a file of up to
/// [`MAX_FILE_BYTES`], read as it streams, not buffered under
/// `server.max_body_bytes`.
pub fn upload_router() -> Router<AppState> {
    Router::new().route("/v1/attachments", post(upload_attachment))
}

pub fn router() -> Router<AppState> {
    Router::new().route(
        "/v1/attachments/{attachment_id}",
        get(get_attachment).delete(delete_attachment),
    )
}

/// An uploaded file.
#[derive(Debug, Serialize, ToSchema)]
pub struct AttachmentView {
    /// `att_` and 32 hex digits; what a send names in `attachments`.
    pub id: String,
    /// The file's name as the email gives it (cleaned of paths and of
    /// characters a mail client could misread).
    pub filename: String,
    pub content_type: String,
    /// Bytes.
    pub size: i64,
    /// Hex SHA-256 of the bytes.
    pub sha256: String,
    /// How many messages use it: sends accepted with it whose personal
    /// data retention has not erased yet.
    pub messages: i64,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339: when new sends stop taking it (a day after the upload).
    /// Its bytes stay while messages use it, and go once none does.
    pub expires_at: String,
}

impl From<AttachmentRow> for AttachmentView {
    fn from(row: AttachmentRow) -> Self {
        AttachmentView {
            expires_at: ms_to_rfc3339(row.expires_at),
            id: row.id,
            filename: row.filename,
            content_type: row.content_type,
            size: row.size,
            sha256: row.sha256.unwrap_or_default(),
            messages: row.messages,
            created_at: ms_to_rfc3339(row.created_at),
        }
    }
}

/// `?filename=` of an upload.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct UploadQuery {
    /// The file's name, with the extension of its type (`invoice.pdf`); at
    /// most 100 characters are kept.
    #[param(min_length = 1, max_length = 1000)]
    pub filename: Option<String>,
}

/// Upload a file to attach to an email: the body is the file's bytes,
/// `Content-Type` its type. The type must be one of `application/pdf`,
/// `image/png`, `image/jpeg`, `image/gif`, `text/plain`, `text/csv`,
/// `text/calendar` or `application/json`, and agree with the name's
/// extension and with the bytes themselves. At most 10 MiB. The answer's
/// `id` goes in any number of sends' `attachments` for 24 hours
/// (`expires_at`); a file nothing uses is erased once it expires.
#[utoipa::path(
    post, path = "/v1/attachments", tag = "attachments",
    params(UploadQuery),
    request_body(
        description = "The file's bytes, as they are: no form, no base64.",
        content(
            ("application/pdf"), ("image/png"), ("image/jpeg"), ("image/gif"),
            ("text/plain"), ("text/csv"), ("text/calendar"), ("application/json"),
        ),
    ),
    responses(
        (status = 201, description = "Stored.", body = AttachmentView,
            headers(("Location" = String, description = "/v1/attachments/{attachment_id}"))),
        (status = 400, description = "The body could not be read, or the query is not valid.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 413, description = "The file is larger than 10 MiB (told from `Content-Length` before any byte is read, or when the bytes pass it).", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "`Content-Type` is missing or not a type an attachment may have.", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "`filename` is missing or its extension is not the type's, or the bytes are not of the type (`body`).", body = Problem, content_type = "application/problem+json"),
        (status = 429, response = TooManyUploads),
    ),
    security(("tenant_key" = []))
)]
pub async fn upload_attachment(
    State(state): State<AppState>,
    TenantUpload(caller): TenantUpload,
    headers: HeaderMap,
    query: Result<Query<UploadQuery>, QueryRejection>,
    body: Body,
) -> Result<Response, ApiError> {
    let Query(query) =
        query.map_err(|rejection| ApiError::BadRequest(format!("Invalid query: {rejection}.")))?;
    let scope = caller.scope();
    let content_length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let upload = Upload {
        scope: &scope,
        content_type: headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
        filename: query.filename.as_deref(),
        content_length,
        held_at_most: i64::try_from(caller.plan.upload_bytes_held).unwrap_or(i64::MAX),
    };
    let row = crate::attachments::receive(&state.db, upload, body)
        .await
        .map_err(|err| refused(err, &caller.plan.name))?;
    let location = format!("/v1/attachments/{}", row.id);
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(AttachmentView::from(row)),
    )
        .into_response())
}

/// An upload's refusal as the API answers it (`plan`: the tenant's).
fn refused(refused: UploadRefused, plan: &str) -> ApiError {
    match refused {
        UploadRefused::Held { held, limit } => ApiError::UploadBytesHeld(format!(
            "Plan {plan:?} lets a tenant's files hold {limit} bytes in each world, and this \
             world's hold {held}: delete files no send needs (DELETE /v1/attachments/{{id}}), \
             or wait until unused ones expire, a day after their upload."
        )),
        UploadRefused::Type(detail) => ApiError::UnsupportedMediaType(format!("{detail}.")),
        UploadRefused::Field { field, message } => {
            ApiError::Validation([(field.to_owned(), message)].into())
        }
        UploadRefused::TooLarge => ApiError::PayloadTooLarge(format!(
            "The file is larger than {MAX_FILE_BYTES} bytes, the most an attachment may have."
        )),
        UploadRefused::Body(err) => body_too_late(&err, "nothing was stored")
            .unwrap_or_else(|| ApiError::BadRequest(format!("The file could not be read: {err}."))),
        UploadRefused::Store(err) => err.into(),
    }
}

/// One of the caller's uploaded files (its world's).
#[utoipa::path(
    get, path = "/v1/attachments/{attachment_id}", tag = "attachments",
    params(("attachment_id" = String, Path, description = "Attachment id.")),
    responses(
        (status = 200, description = "The file's name, type, size and hash.", body = AttachmentView),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No such file of the caller's (a test key's files and a live key's are apart), or it was erased.", body = Problem, content_type = "application/problem+json"),
    ),
    security(("tenant_key" = []))
)]
pub async fn get_attachment(
    State(state): State<AppState>,
    TenantAuth(caller): TenantAuth,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<AttachmentView>, ApiError> {
    match state.db.attachment(&caller.scope(), &id).await? {
        Some(row) => Ok(Json(row.into())),
        None => Err(ApiError::NotFound("No such attachment.".into())),
    }
}

/// Delete one of the caller's files (its world's): new sends naming it are
/// refused (422). Its bytes go at once when no message uses it; else sends
/// accepted with it still go out with it, and its bytes go when retention
/// erases the last of them.
#[utoipa::path(
    delete, path = "/v1/attachments/{attachment_id}", tag = "attachments",
    params(("attachment_id" = String, Path, description = "Attachment id.")),
    responses(
        (status = 204, description = "Deleted."),
        (status = 400, description = "A path segment is not valid UTF-8.", body = Problem, content_type = "application/problem+json"),
        (status = 401, response = TenantUnauthorized),
        (status = 404, description = "No such file of the caller's (a test key's files and a live key's are apart), or it was deleted or erased.", body = Problem, content_type = "application/problem+json"),
        (status = 429, response = TooManyChanges),
    ),
    security(("tenant_key" = []))
)]
pub async fn delete_attachment(
    State(state): State<AppState>,
    TenantWrite(caller): TenantWrite,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let scope = caller.scope();
    match state.db.delete_attachment(&scope, &id, now_ms()).await? {
        Deleted::NotFound => Err(ApiError::NotFound("No such attachment.".into())),
        done => {
            let tenant = scope.tenant();
            let erased = done == Deleted::Erased;
            tracing::info!(%tenant, attachment = %id, erased, "Attachment deleted.");
            Ok(StatusCode::NO_CONTENT)
        }
    }
}
