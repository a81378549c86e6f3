//! Why a store call failed, in the cases its callers act on: the thing is
//! not there, it clashes with what is, or the store cannot answer now
//! (unreachable, timed out, or out of room). The API maps these once
//! (`crate::api::error`): 404, 409 and 503 with Retry-After, never a 500
//! for a store that is merely away.

use std::time::Duration;

/// A store failure, classified.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    /// The store could not be reached, or did not answer in time; the same
    /// call may work a moment later.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// The store refused a write for lack of room (`storage.max_size_mb`,
    /// a full disk).
    #[error("the store is full: {0}")]
    Full(String),
    #[error(transparent)]
    Other(anyhow::Error),
}

/// What every operation of the store's interface answers.
pub type StoreResult<T> = Result<T, StoreError>;

impl From<anyhow::Error> for StoreError {
    fn from(err: anyhow::Error) -> Self {
        StoreError::classify(err)
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        StoreError::classify(err.into())
    }
}

impl From<rusqlite::Error> for StoreError {
    fn from(err: rusqlite::Error) -> Self {
        StoreError::classify(err.into())
    }
}

impl StoreError {
    /// How long a caller should wait before trying again, for the failures
    /// that pass: a read that found the store away costs nothing to repeat,
    /// and a second is where the writer's own backoff starts.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            StoreError::Unavailable(_) | StoreError::Full(_) => Some(Duration::from_secs(1)),
            _ => None,
        }
    }

    /// Classifies an error from a store call by what its chain holds.
    pub fn classify(err: anyhow::Error) -> StoreError {
        let err = match err.downcast::<StoreError>() {
            Ok(classified) => return classified,
            Err(err) => err,
        };
        for cause in err.chain() {
            if let Some(classified) = cause.downcast_ref::<StoreError>() {
                match classified {
                    StoreError::NotFound(what) => return StoreError::NotFound(what.clone()),
                    StoreError::Conflict(what) => return StoreError::Conflict(what.clone()),
                    StoreError::Unavailable(why) => return StoreError::Unavailable(why.clone()),
                    StoreError::Full(why) => return StoreError::Full(why.clone()),
                    StoreError::Other(_) => {}
                }
            }
            if let Some(err) = cause.downcast_ref::<sqlx::Error>() {
                match of_sqlx(err) {
                    Some(Kind::Unavailable) => return StoreError::Unavailable(format!("{err}")),
                    Some(Kind::Full) => return StoreError::Full(format!("{err}")),
                    None => {}
                }
            }
            if let Some(err) = cause.downcast_ref::<rusqlite::Error>() {
                use rusqlite::ErrorCode;
                match err.sqlite_error_code() {
                    Some(ErrorCode::DiskFull) => return StoreError::Full(format!("{err}")),
                    // Still locked after the busy timeout, or the file
                    // could not be opened: the store is away for now.
                    Some(
                        ErrorCode::DatabaseBusy
                        | ErrorCode::DatabaseLocked
                        | ErrorCode::CannotOpen
                        | ErrorCode::SystemIoFailure,
                    ) => return StoreError::Unavailable(format!("{err}")),
                    _ => {}
                }
            }
        }
        StoreError::Other(err)
    }
}

enum Kind {
    Unavailable,
    Full,
}

fn of_sqlx(err: &sqlx::Error) -> Option<Kind> {
    match err {
        // Not reached, timed out, or the connection broke mid-conversation
        // (a peer that closes during the handshake reads as a protocol
        // error).
        sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => Some(Kind::Unavailable),
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // SQLite's SQLITE_FULL; PostgreSQL's disk_full.
            Some("13") | Some("53100") => Some(Kind::Full),
            // PostgreSQL: admin shutdown, crash shutdown, cannot connect now.
            Some("57P01") | Some("57P02") | Some("57P03") => Some(Kind::Unavailable),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_that_cannot_connect_is_unavailable_and_anything_else_is_other() {
        let away = anyhow::Error::from(sqlx::Error::PoolTimedOut).context("reading a message");
        let classified = StoreError::classify(away);
        assert!(
            matches!(classified, StoreError::Unavailable(_)),
            "{classified:?}"
        );
        assert_eq!(classified.retry_after(), Some(Duration::from_secs(1)));
        let bug = anyhow::anyhow!("stored status \"nope\" is not valid");
        assert!(matches!(StoreError::classify(bug), StoreError::Other(_)));
    }
}
