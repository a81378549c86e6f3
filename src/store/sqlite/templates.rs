//! A tenant's templates on SQLite.

use async_trait::async_trait;
use rusqlite::{OptionalExtension, params};

use super::{SqliteDb, args};
use crate::store::templates::{
    MAX_TEMPLATES_PER_TENANT, TemplateRow, TemplateStore, TemplateVersionRow,
};
use crate::store::{StoreError, StoreResult};

const COLUMNS: &str = "id, tenant_id, channel, name, version, created_at, updated_at";

fn template_row(row: &rusqlite::Row) -> rusqlite::Result<TemplateRow> {
    Ok(TemplateRow {
        id: row.get(0)?,
        tenant_id: row.get(1)?,
        channel: row.get(2)?,
        name: row.get(3)?,
        version: row.get(4)?,
        created_at: row.get(5)?,
        updated_at: row.get(6)?,
    })
}

fn version_row(row: &rusqlite::Row) -> rusqlite::Result<TemplateVersionRow> {
    Ok(TemplateVersionRow {
        template_id: row.get(0)?,
        version: row.get(1)?,
        body: row.get(2)?,
        created_at: row.get(3)?,
    })
}

/// `Conflict` when another live template of the tenant is named `name`.
fn refuse_taken_name(
    tx: &rusqlite::Transaction,
    tenant_id: &str,
    name: &str,
    except: &str,
) -> anyhow::Result<()> {
    const TAKEN: &str = "SELECT 1 FROM templates WHERE tenant_id = ?1 AND name = ?2 \
         AND id <> ?3 AND deleted_at IS NULL";
    let taken = tx
        .prepare_cached(TAKEN)?
        .query_row(params![tenant_id, name, except], |_| Ok(()))
        .optional()?;
    if taken.is_some() {
        return Err(
            StoreError::Conflict(format!("Another template is already named {name:?}.")).into(),
        );
    }
    Ok(())
}

const INSERT_VERSION: &str = "INSERT INTO template_versions (template_id, version, tenant_id, \
     body, created_at) VALUES (?1, ?2, ?3, ?4, ?5)";

#[async_trait]
impl TemplateStore for SqliteDb {
    async fn insert_template(&self, row: &TemplateRow, body: &str) -> StoreResult<()> {
        const COUNT: &str =
            "SELECT count(*) FROM templates WHERE tenant_id = ?1 AND deleted_at IS NULL";
        const INSERT: &str = "INSERT INTO templates (id, tenant_id, channel, name, version, \
             created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";
        let (row, body) = (row.clone(), body.to_owned());
        Ok(self
            .transact(move |tx| {
                let count: i64 = tx.query_row(COUNT, [&row.tenant_id], |r| r.get(0))?;
                if count >= MAX_TEMPLATES_PER_TENANT {
                    return Err(StoreError::Conflict(format!(
                        "The tenant has {MAX_TEMPLATES_PER_TENANT} templates, the most it may keep; delete one first."
                    ))
                    .into());
                }
                refuse_taken_name(tx, &row.tenant_id, &row.name, &row.id)?;
                tx.execute(
                    INSERT,
                    params![
                        row.id,
                        row.tenant_id,
                        row.channel,
                        row.name,
                        row.version,
                        row.created_at,
                        row.updated_at
                    ],
                )?;
                tx.execute(
                    INSERT_VERSION,
                    params![row.id, row.version, row.tenant_id, body, row.created_at],
                )?;
                Ok(())
            })
            .await?)
    }

    async fn add_template_version(
        &self,
        tenant_id: &str,
        id: &str,
        name: &str,
        body: &str,
        now: i64,
    ) -> StoreResult<u32> {
        const BUMP: &str = "UPDATE templates SET version = version + 1, name = ?3, \
             updated_at = ?4 WHERE tenant_id = ?1 AND id = ?2 AND deleted_at IS NULL \
             RETURNING version";
        let (tenant_id, id, name, body) = (
            tenant_id.to_owned(),
            id.to_owned(),
            name.to_owned(),
            body.to_owned(),
        );
        Ok(self
            .transact(move |tx| {
                refuse_taken_name(tx, &tenant_id, &name, &id)?;
                let version: Option<u32> = tx
                    .prepare_cached(BUMP)?
                    .query_row(params![tenant_id, id, name, now], |r| r.get(0))
                    .optional()?;
                let Some(version) = version else {
                    return Err(StoreError::NotFound(format!("No template {id:?}.")).into());
                };
                tx.execute(INSERT_VERSION, params![id, version, tenant_id, body, now])?;
                Ok(version)
            })
            .await?)
    }

    async fn template(
        &self,
        tenant_id: &str,
        id: &str,
        version: Option<u32>,
    ) -> StoreResult<Option<(TemplateRow, TemplateVersionRow)>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM templates WHERE tenant_id = ?1 AND id = ?2 AND deleted_at IS NULL"
        );
        let Some(row) = self
            .row(
                sql,
                args![tenant_id.to_owned(), id.to_owned()],
                template_row,
            )
            .await?
        else {
            return Ok(None);
        };
        let version = version.unwrap_or(row.version);
        Ok(self
            .template_version(tenant_id, id, version)
            .await?
            .map(|found| (row, found)))
    }

    async fn template_version(
        &self,
        tenant_id: &str,
        id: &str,
        version: u32,
    ) -> StoreResult<Option<TemplateVersionRow>> {
        const READ: &str = "SELECT template_id, version, body, created_at FROM template_versions \
             WHERE template_id = ?1 AND version = ?2 AND tenant_id = ?3";
        let args = args![id.to_owned(), version, tenant_id.to_owned()];
        Ok(self.row(READ, args, version_row).await?)
    }

    async fn templates_of(&self, tenant_id: &str) -> StoreResult<Vec<TemplateRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM templates WHERE tenant_id = ?1 AND deleted_at IS NULL ORDER BY id"
        );
        Ok(self
            .rows(sql, args![tenant_id.to_owned()], template_row)
            .await?)
    }

    async fn delete_template(&self, tenant_id: &str, id: &str, now: i64) -> StoreResult<bool> {
        const DELETE: &str = "UPDATE templates SET deleted_at = ?3, updated_at = ?3 \
             WHERE tenant_id = ?1 AND id = ?2 AND deleted_at IS NULL";
        let args = args![tenant_id.to_owned(), id.to_owned(), now];
        Ok(self.execute(DELETE, args).await? == 1)
    }
}
