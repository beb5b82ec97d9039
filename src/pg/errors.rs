//! Sorting database failures by what the consumer does with them
//! (docs/ARCHITECTURE.md#error-classes): transient ones
//! roll back and wait for redelivery; anything unclassified is retried a limited number of
//! times by the broker and then lands in the DLQ.

use tokio_postgres::error::SqlState;

/// Why a transaction did not commit.
#[derive(Debug, thiserror::Error)]
pub enum TxError {
    /// Connection lost, timeout, deadlock, serialization failure, commit result unknown,
    /// pool exhausted: roll back, do not ACK, let the broker redeliver.
    #[error("transient: {0}")]
    Transient(String),
    /// Not understood: retried a bounded number of times by the broker, then DLQ.
    #[error("unknown: {0}")]
    Unknown(String),
}

impl TxError {
    pub fn class(&self) -> &'static str {
        match self {
            TxError::Transient(_) => "transient",
            TxError::Unknown(_) => "unknown",
        }
    }
}

/// Classifies a driver error by SQLSTATE class and connection state.
pub fn classify(err: &tokio_postgres::Error) -> TxError {
    let text = match err.as_db_error() {
        Some(db) => format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
        None => match std::error::Error::source(err) {
            Some(src) => format!("{err}: {src}"),
            None => err.to_string(),
        },
    };
    if err.is_closed() {
        return TxError::Transient(text);
    }
    match err.code() {
        Some(code) if is_transient_state(code) => {
            if *code == SqlState::T_R_DEADLOCK_DETECTED {
                metrics::counter!("pg_deadlock_total").increment(1);
            }
            if *code == SqlState::T_R_SERIALIZATION_FAILURE {
                metrics::counter!("pg_serialization_retry_total").increment(1);
            }
            TxError::Transient(text)
        }
        Some(_) => TxError::Unknown(text),
        // No SQLSTATE: an I/O error or a protocol problem, i.e. the connection is gone.
        None => TxError::Transient(text),
    }
}

/// SQLSTATEs worth a retry: connection exceptions (08), transaction rollbacks (40),
/// insufficient resources (53), operator intervention (57: statement timeout, admin shutdown).
pub fn is_transient_state(code: &SqlState) -> bool {
    let c = code.code();
    c.starts_with("08") || c.starts_with("40") || c.starts_with("53") || c.starts_with("57")
}

impl From<tokio_postgres::Error> for TxError {
    fn from(e: tokio_postgres::Error) -> Self {
        classify(&e)
    }
}

impl From<deadpool_postgres::PoolError> for TxError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(be) => classify(&be),
            other => TxError::Transient(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_sorted_by_decision() {
        for s in [
            SqlState::T_R_DEADLOCK_DETECTED,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::CONNECTION_FAILURE,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::QUERY_CANCELED,
            SqlState::TOO_MANY_CONNECTIONS,
        ] {
            assert!(is_transient_state(&s), "{s:?}");
        }
        for s in [
            SqlState::UNIQUE_VIOLATION,
            SqlState::FOREIGN_KEY_VIOLATION,
            SqlState::SYNTAX_ERROR,
            SqlState::UNDEFINED_TABLE,
        ] {
            assert!(!is_transient_state(&s), "{s:?}");
        }
    }
}
