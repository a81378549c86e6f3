//! Reads of the SQLite file through rusqlite, the store writer's driver:
//! a few threads, each with a read-only connection of its own, taking
//! reads from one queue. A read costs a quarter of the CPU it costs through
//! sqlx's pool under load (`examples/sqlite_drivers`, bench/README.md
//! "One SQLite driver: which"). In WAL mode a reader never waits for the
//! writer. The threads end once every handle to the store is gone.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use rusqlite::{Connection, OpenFlags};
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce(&Connection) + Send>;

/// The reader threads' queue; cheap to clone.
#[derive(Clone)]
pub struct Readers {
    jobs: mpsc::Sender<Job>,
    /// Bumped when the planner's statistics were taken afresh: a reader
    /// that finds it changed opens its connection again before its next
    /// read, since a connection keeps the statistics it opened with.
    statistics: Arc<AtomicU64>,
}

impl std::fmt::Debug for Readers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Readers")
    }
}

impl Readers {
    /// Opens `count` read-only connections to the (migrated) file at
    /// `path`, each on a thread of its own.
    pub(crate) fn open(path: &Path, count: usize) -> anyhow::Result<Readers> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        let statistics = Arc::new(AtomicU64::new(0));
        for n in 0..count.max(1) {
            let mut conn = open_reader(path)?;
            let (queue, statistics, path) =
                (Arc::clone(&queue), Arc::clone(&statistics), path.to_owned());
            let mut seen = 0;
            std::thread::Builder::new()
                .name(format!("sqlite-reader-{n}"))
                .spawn(move || {
                    loop {
                        let job = queue.lock().unwrap_or_else(PoisonError::into_inner).recv();
                        let Ok(job) = job else {
                            return;
                        };
                        let now = statistics.load(Ordering::Acquire);
                        if now != seen {
                            match open_reader(&path) {
                                Ok(fresh) => (conn, seen) = (fresh, now),
                                Err(err) => tracing::warn!(error = %format!("{err:#}"), "Could not reopen a SQLite reader; it reads with its old statistics."),
                            }
                        }
                        job(&conn);
                    }
                })
                .context("starting a SQLite reader thread")?;
        }
        Ok(Readers { jobs, statistics })
    }

    /// Has every reader open its connection again before its next read,
    /// to plan with statistics just taken.
    pub(crate) fn reload_statistics(&self) {
        self.statistics.fetch_add(1, Ordering::Release);
    }

    /// Runs `read` on the next free reader and returns what it found.
    pub(crate) async fn read<T, F>(&self, read: F) -> anyhow::Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        self.jobs
            .send(Box::new(move |conn| {
                let _ = answer.send(read(conn));
            }))
            .map_err(|_| anyhow::anyhow!("the SQLite readers have stopped"))?;
        Ok(answered.await.context("a SQLite reader stopped")??)
    }
}

/// A read-only connection to the file at `path`.
fn open_reader(path: &Path) -> anyhow::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .with_context(|| format!("opening {} for reading", path.display()))?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.set_prepared_statement_cache_capacity(64);
    Ok(conn)
}
