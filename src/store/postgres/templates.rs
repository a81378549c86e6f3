//! A tenant's templates on PostgreSQL.

use async_trait::async_trait;
use sqlx::{PgConnection, Row};

use super::PgDb;
use crate::store::templates::{
    MAX_TEMPLATES_PER_TENANT, TemplateRow, TemplateStore, TemplateVersionRow,
};
use crate::store::{StoreError, StoreResult};

const COLUMNS: &str = "id, tenant_id, channel, name, version, created_at, updated_at";

fn template_row(row: &sqlx::postgres::PgRow) -> Result<TemplateRow, sqlx::Error> {
    Ok(TemplateRow {
        id: row.try_get(0)?,
        tenant_id: row.try_get(1)?,
        channel: row.try_get(2)?,
        name: row.try_get(3)?,
        version: u32::try_from(row.try_get::<i32, _>(4)?).unwrap_or(0),
        created_at: row.try_get(5)?,
        updated_at: row.try_get(6)?,
    })
}

/// `Conflict` when another live template of the tenant is named `name`.
async fn refuse_taken_name(
    tx: &mut PgConnection,
    tenant_id: &str,
    name: &str,
    except: &str,
) -> StoreResult<()> {
    const TAKEN: &str = "SELECT 1 FROM templates WHERE tenant_id = $1 AND name = $2 \
         AND id <> $3 AND deleted_at IS NULL";
    let taken = sqlx::query(TAKEN)
        .bind(tenant_id)
        .bind(name)
        .bind(except)
        .fetch_optional(tx)
        .await?;
    match taken {
        Some(_) => Err(StoreError::Conflict(format!(
            "Another template is already named {name:?}."
        ))),
        None => Ok(()),
    }
}

/// A unique-name violation of a race the check above lost, as `Conflict`.
fn named_conflict(err: sqlx::Error, name: &str) -> StoreError {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Conflict(format!("Another template is already named {name:?}."))
        }
        _ => err.into(),
    }
}

const INSERT_VERSION: &str = "INSERT INTO template_versions (template_id, version, tenant_id, \
     body, created_at) VALUES ($1, $2, $3, $4, $5)";

#[async_trait]
impl TemplateStore for PgDb {
    async fn insert_template(&self, row: &TemplateRow, body: &str) -> StoreResult<()> {
        const COUNT: &str =
            "SELECT count(*) FROM templates WHERE tenant_id = $1 AND deleted_at IS NULL";
        const INSERT: &str = "INSERT INTO templates (id, tenant_id, channel, name, version, \
             created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7)";
        let mut tx = self.pool.begin().await?;
        let count: i64 = sqlx::query_scalar(COUNT)
            .bind(&row.tenant_id)
            .fetch_one(&mut *tx)
            .await?;
        if count >= MAX_TEMPLATES_PER_TENANT {
            return Err(StoreError::Conflict(format!(
                "The tenant has {MAX_TEMPLATES_PER_TENANT} templates, the most it may keep; delete one first."
            )));
        }
        refuse_taken_name(&mut tx, &row.tenant_id, &row.name, &row.id).await?;
        sqlx::query(INSERT)
            .bind(&row.id)
            .bind(&row.tenant_id)
            .bind(&row.channel)
            .bind(&row.name)
            .bind(row.version as i32)
            .bind(row.created_at)
            .bind(row.updated_at)
            .execute(&mut *tx)
            .await
            .map_err(|err| named_conflict(err, &row.name))?;
        sqlx::query(INSERT_VERSION)
            .bind(&row.id)
            .bind(row.version as i32)
            .bind(&row.tenant_id)
            .bind(body)
            .bind(row.created_at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn add_template_version(
        &self,
        tenant_id: &str,
        id: &str,
        name: &str,
        body: &str,
        now: i64,
    ) -> StoreResult<u32> {
        const BUMP: &str = "UPDATE templates SET version = version + 1, name = $3, \
             updated_at = $4 WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL \
             RETURNING version";
        let mut tx = self.pool.begin().await?;
        refuse_taken_name(&mut tx, tenant_id, name, id).await?;
        let version: Option<i32> = sqlx::query_scalar(BUMP)
            .bind(tenant_id)
            .bind(id)
            .bind(name)
            .bind(now)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|err| named_conflict(err, name))?;
        let Some(version) = version else {
            return Err(StoreError::NotFound(format!("No template {id:?}.")));
        };
        sqlx::query(INSERT_VERSION)
            .bind(id)
            .bind(version)
            .bind(tenant_id)
            .bind(body)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(u32::try_from(version).unwrap_or(0))
    }

    async fn template(
        &self,
        tenant_id: &str,
        id: &str,
        version: Option<u32>,
    ) -> StoreResult<Option<(TemplateRow, TemplateVersionRow)>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM templates WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL"
        );
        let found = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = found.as_ref().map(template_row).transpose()? else {
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
             WHERE template_id = $1 AND version = $2 AND tenant_id = $3";
        let found: Option<(String, i32, String, i64)> = sqlx::query_as(READ)
            .bind(id)
            .bind(i32::try_from(version).unwrap_or(i32::MAX))
            .bind(tenant_id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(found.map(
            |(template_id, version, body, created_at)| TemplateVersionRow {
                template_id,
                version: u32::try_from(version).unwrap_or(0),
                body,
                created_at,
            },
        ))
    }

    async fn templates_of(&self, tenant_id: &str) -> StoreResult<Vec<TemplateRow>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM templates WHERE tenant_id = $1 AND deleted_at IS NULL ORDER BY id"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await?;
        Ok(rows.iter().map(template_row).collect::<Result<_, _>>()?)
    }

    async fn delete_template(&self, tenant_id: &str, id: &str, now: i64) -> StoreResult<bool> {
        const DELETE: &str = "UPDATE templates SET deleted_at = $3, updated_at = $3 \
             WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL";
        let done = sqlx::query(DELETE)
            .bind(tenant_id)
            .bind(id)
            .bind(now)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}
