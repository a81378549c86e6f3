//! The SQLite file's schema, brought up to date through rusqlite, the one
//! driver of this backend. The scripts are `migrations/sqlite`, embedded
//! at build time; the ledger of applied ones is the table sqlx's migrator
//! kept before (`_sqlx_migrations`, same columns, same SHA-384 checksums),
//! so a file an earlier fairlane created opens unchanged, and a file this
//! one migrated would open under the earlier one.

use anyhow::{Context, bail};
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};

static SCRIPTS: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
    success BOOLEAN NOT NULL,
    checksum BLOB NOT NULL,
    execution_time BIGINT NOT NULL
)";

/// Applies, in order and each in its own transaction with its ledger row,
/// every script the file has not had. Refuses a file whose ledger shows a
/// script that failed half-way, or one that was applied with other text
/// (an edited migration), or one newer than this build knows.
pub(crate) fn run(conn: &mut Connection) -> anyhow::Result<()> {
    conn.execute_batch(LEDGER)
        .context("creating the migrations' ledger")?;
    let dirty: Option<i64> = conn
        .query_row(
            "SELECT version FROM _sqlx_migrations WHERE NOT success ORDER BY version LIMIT 1",
            [],
            |row| row.get(0),
        )
        .optional()?;
    if let Some(version) = dirty {
        bail!("migration {version} of the SQLite file failed part-way; restore a backup");
    }
    let applied: Vec<(i64, Vec<u8>)> = conn
        .prepare("SELECT version, checksum FROM _sqlx_migrations ORDER BY version")?
        .query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let known = SCRIPTS
        .iter()
        .map(|script| script.version)
        .max()
        .unwrap_or(0);
    if let Some((version, _)) = applied.iter().find(|(version, _)| *version > known) {
        bail!(
            "the SQLite file has migration {version}, newer than this build knows ({known}); \
             run the fairlane that wrote it"
        );
    }
    for script in SCRIPTS.iter() {
        match applied
            .iter()
            .find(|(version, _)| *version == script.version)
        {
            Some((_, checksum)) if checksum[..] == script.checksum[..] => continue,
            Some(_) => bail!(
                "migration {} ({}) was applied from a different text",
                script.version,
                script.description
            ),
            None => {}
        }
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        tx.execute_batch(script.sql.as_str()).with_context(|| {
            format!(
                "applying migration {} ({})",
                script.version, script.description
            )
        })?;
        tx.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (?1, ?2, TRUE, ?3, -1)",
            params![script.version, &*script.description, &*script.checksum],
        )?;
        tx.commit()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_file_takes_every_script_once_and_a_second_run_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = Connection::open(dir.path().join("m.db")).unwrap();
        run(&mut conn).unwrap();
        let count = |conn: &Connection| -> i64 {
            conn.query_row("SELECT COUNT(*) FROM _sqlx_migrations", [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(count(&conn), SCRIPTS.iter().count() as i64);
        run(&mut conn).unwrap();
        assert_eq!(count(&conn), SCRIPTS.iter().count() as i64);
        let tables: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'messages'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(tables, 1);
    }

    #[test]
    fn an_edited_or_unknown_migration_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = Connection::open(dir.path().join("m.db")).unwrap();
        run(&mut conn).unwrap();
        conn.execute(
            "UPDATE _sqlx_migrations SET checksum = x'00' WHERE version = 1",
            [],
        )
        .unwrap();
        let err = run(&mut conn).unwrap_err().to_string();
        assert!(err.contains("different text"), "{err}");
        conn.execute(
            "UPDATE _sqlx_migrations SET checksum = ?1 WHERE version = 1",
            [&*SCRIPTS.iter().next().unwrap().checksum],
        )
        .unwrap();
        conn.execute(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99999, 'later', TRUE, x'00', -1)",
            [],
        )
        .unwrap();
        let err = run(&mut conn).unwrap_err().to_string();
        assert!(err.contains("newer than this build"), "{err}");
    }
}
