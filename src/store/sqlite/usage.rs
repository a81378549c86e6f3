//! The SQLite side of usage counting: what a writer's group has counted,
//! summed per key on the writing thread and written once per key before
//! the group commits (see [`crate::store::usage`] for the rows and their
//! reads).

use std::cell::RefCell;
use std::collections::HashMap;

use crate::store::StoreResult;
use async_trait::async_trait;

use super::{SqliteDb, args};
use crate::store::usage::{UsageRow, UsageStore, Whose, summed_counters};
use crate::store::usage_counters::COUNTERS;

/// What a group of the SQLite store writer has counted and not yet written,
/// per tenant, day, channel and kind: every counter of [`COUNTERS`]. It
/// lives on the thread that runs the transaction (the store writer's, or a
/// rare writer's: [`crate::store::SqliteDb::transact`]), where every accept
/// and every status change ([`crate::store::lifecycle`]) counts; the writer
/// writes it into the transaction just before the commit
/// ([`Pending::write`]) and forgets it when the transaction is rolled back
/// ([`Pending::forget`]). One upsert per key and group instead of one per
/// message.
pub struct Pending;

/// Tenant, UTC day, channel and kind (test or live).
type UsageKey = (String, i64, String, bool);

thread_local! {
    static PENDING: RefCell<HashMap<UsageKey, [i64; COUNTERS.len()]>> = RefCell::new(HashMap::new());
}

const MS_PER_DAY: i64 = 86_400_000;

/// The upsert of one key's counts: every counter added to.
static UPSERT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let columns = COUNTERS.join(", ");
    let places: Vec<String> = (5..5 + COUNTERS.len()).map(|n| format!("?{n}")).collect();
    let sums: Vec<String> = COUNTERS
        .iter()
        .map(|c| format!("{c} = {c} + excluded.{c}"))
        .collect();
    format!(
        "INSERT INTO usage (tenant_id, day, channel, test, {columns}) VALUES (?1, ?2, ?3, ?4, {}) \
         ON CONFLICT (tenant_id, day, channel, test) DO UPDATE SET {}",
        places.join(", "),
        sums.join(", ")
    )
});

impl Pending {
    fn add(tenant_id: &str, at_ms: i64, channel: &str, test: bool, column: &str, by: i64) {
        let Some(index) = COUNTERS.iter().position(|c| *c == column) else {
            return;
        };
        PENDING.with(|pending| {
            let mut pending = pending.borrow_mut();
            let key = (
                tenant_id.to_owned(),
                at_ms.div_euclid(MS_PER_DAY),
                channel.to_owned(),
                test,
            );
            pending.entry(key).or_default()[index] += by;
        });
    }

    /// A message stored at `created_at` (ms), with the bytes of its files.
    pub fn accepted(tenant_id: &str, created_at: i64, channel: &str, test: bool, files: i64) {
        Self::add(tenant_id, created_at, channel, test, "accepted", 1);
        if files > 0 {
            Self::add(
                tenant_id,
                created_at,
                channel,
                test,
                "attachment_bytes",
                files,
            );
        }
    }

    /// A message that reached the state of `column` (a counter of
    /// [`COUNTERS`]) at `at` (ms); `sent` adds its fragments too.
    pub fn reached(
        tenant_id: &str,
        at: i64,
        channel: &str,
        test: bool,
        column: &str,
        fragments: Option<i64>,
    ) {
        Self::add(tenant_id, at, channel, test, column, 1);
        if column == "sent" {
            Self::add(
                tenant_id,
                at,
                channel,
                test,
                "fragments",
                fragments.unwrap_or(0),
            );
        }
    }

    /// Writes what was counted into `tx` (one upsert per key) and forgets it.
    pub fn write(tx: &rusqlite::Transaction) -> rusqlite::Result<()> {
        let counted = PENDING.with(|pending| std::mem::take(&mut *pending.borrow_mut()));
        if counted.is_empty() {
            return Ok(());
        }
        let mut upsert = tx.prepare_cached(&UPSERT)?;
        for ((tenant_id, day, channel, test), counts) in counted {
            let mut values: Vec<&dyn rusqlite::ToSql> = vec![&tenant_id, &day, &channel, &test];
            values.extend(counts.iter().map(|count| count as &dyn rusqlite::ToSql));
            upsert.execute(values.as_slice())?;
        }
        Ok(())
    }

    /// Forgets what was counted (its transaction was rolled back).
    pub fn forget() {
        PENDING.with(|pending| pending.borrow_mut().clear());
    }
}

#[async_trait]
impl UsageStore for SqliteDb {
    async fn usage(
        &self,
        whose: Whose<'_>,
        from_day: i64,
        to_day: i64,
    ) -> StoreResult<Vec<UsageRow>> {
        let (tenant_id, test) = whose.bounds();
        let sql = format!(
            "SELECT tenant_id, day, channel, test, {sums} FROM usage \
             WHERE day BETWEEN ?1 AND ?2 AND (?3 IS NULL OR tenant_id = ?3) \
             AND (?4 IS NULL OR test = ?4) \
             GROUP BY tenant_id, day, channel, test ORDER BY tenant_id, day, channel, test",
            sums = summed_counters()
        );
        let args = args![from_day, to_day, tenant_id.map(str::to_owned), test];
        Ok(self
            .rows(sql, args, |row| {
                Ok(UsageRow {
                    tenant_id: row.get(0)?,
                    day: row.get(1)?,
                    channel: row.get(2)?,
                    test: row.get(3)?,
                    accepted: row.get(4)?,
                    sent: row.get(5)?,
                    delivered: row.get(6)?,
                    bounced: row.get(7)?,
                    complained: row.get(8)?,
                    failed: row.get(9)?,
                    dead_lettered: row.get(10)?,
                    suppressed: row.get(11)?,
                    cancelled: row.get(12)?,
                    rejected: row.get(13)?,
                    fragments: row.get(14)?,
                    attachment_bytes: row.get(15)?,
                    redriven: row.get(16)?,
                })
            })
            .await?)
    }

    async fn roll_up_usage(&self) -> StoreResult<Option<u64>> {
        Ok(None)
    }
}
