//! A tenant's templates as the store keeps them: one row per template (its
//! newest version's name and number) and every version's content as JSON,
//! which `crate::templates` reads and checks. Versions are never changed
//! once written, so a message names the one it was rendered from.

use async_trait::async_trait;

use super::StoreResult;

/// A template's row: what lists show without reading its content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateRow {
    pub id: String,
    pub tenant_id: String,
    pub channel: String,
    pub name: String,
    /// The newest version's number (the first is 1).
    pub version: u32,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One version of a template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateVersionRow {
    pub template_id: String,
    pub version: u32,
    /// The version's content, as JSON.
    pub body: String,
    pub created_at: i64,
}

/// Most templates one tenant may keep (deleted ones not counted).
pub const MAX_TEMPLATES_PER_TENANT: i64 = 1000;

/// A tenant's templates, on either backend.
#[async_trait]
pub trait TemplateStore: Send + Sync {
    /// Stores a new template as its version 1; `Conflict` when the tenant
    /// already has [`MAX_TEMPLATES_PER_TENANT`] or one of the same name.
    async fn insert_template(&self, row: &TemplateRow, body: &str) -> StoreResult<()>;

    /// Adds the next version of `tenant_id`'s template `id`, named `name`;
    /// its number, or `NotFound` for a template that is not there (or
    /// deleted), `Conflict` for a name another template has.
    async fn add_template_version(
        &self,
        tenant_id: &str,
        id: &str,
        name: &str,
        body: &str,
        now: i64,
    ) -> StoreResult<u32>;

    /// The template and one of its versions (the newest when `version` is
    /// `None`); none when the template is not there or is deleted, or has
    /// no such version.
    async fn template(
        &self,
        tenant_id: &str,
        id: &str,
        version: Option<u32>,
    ) -> StoreResult<Option<(TemplateRow, TemplateVersionRow)>>;

    /// One version of a template, deleted or not: what a queued message
    /// is rendered from.
    async fn template_version(
        &self,
        tenant_id: &str,
        id: &str,
        version: u32,
    ) -> StoreResult<Option<TemplateVersionRow>>;

    /// The tenant's templates that are not deleted, by id.
    async fn templates_of(&self, tenant_id: &str) -> StoreResult<Vec<TemplateRow>>;

    /// Marks a template deleted (no new sends name it); true when it was
    /// there.
    async fn delete_template(&self, tenant_id: &str, id: &str, now: i64) -> StoreResult<bool>;
}
