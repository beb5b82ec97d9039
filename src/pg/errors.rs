//! Sorting database failures by what the consumer does with them
//! (docs/architecture/order-creation.md#error-classes): transient ones
//! roll back and wait for redelivery; anything unclassified is retried a limited number of
//! times by the broker and then lands in the DLQ.

use tokio_postgres::error::SqlState;

/// Why a transaction did not commit.
#[derive(Debug)]
pub enum TxError {
    /// Connection lost, timeout, deadlock, serialization failure, commit result unknown,
    /// pool exhausted: roll back, do not ACK, let the broker redeliver.
    Transient(Cause),
    /// Not understood: retried a bounded number of times by the broker, then DLQ.
    Unknown(Cause),
}

/// What went wrong, in words for the log, and the error it came from when there is one.
#[derive(Debug)]
pub struct Cause {
    text: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl Cause {
    /// A cause with the driver's (or pool's) error kept as its source.
    pub fn with_source(
        text: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        Cause {
            text: text.into(),
            source: Some(Box::new(source)),
        }
    }
}

impl From<String> for Cause {
    fn from(text: String) -> Self {
        Cause { text, source: None }
    }
}

impl From<&str> for Cause {
    fn from(text: &str) -> Self {
        text.to_owned().into()
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TxError::Transient(c) => write!(f, "transient: {c}"),
            TxError::Unknown(c) => write!(f, "unknown: {c}"),
        }
    }
}

impl std::error::Error for TxError {
    /// The driver's or pool's own error, when the failure came from one.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let (TxError::Transient(c) | TxError::Unknown(c)) = self;
        c.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl TxError {
    pub fn class(&self) -> &'static str {
        match self {
            TxError::Transient(_) => "transient",
            TxError::Unknown(_) => "unknown",
        }
    }
}

/// Classifies a driver error by SQLSTATE class and connection state; the error is kept as the
/// cause's source.
pub fn classify(err: tokio_postgres::Error) -> TxError {
    let text = match err.as_db_error() {
        Some(db) => format!("{} {}: {}", db.severity(), db.code().code(), db.message()),
        None => match std::error::Error::source(&err) {
            Some(src) => format!("{err}: {src}"),
            None => err.to_string(),
        },
    };
    let transient = if err.is_closed() {
        true
    } else {
        match err.code() {
            Some(code) if is_transient_state(code) => {
                if *code == SqlState::T_R_DEADLOCK_DETECTED {
                    metrics::counter!("pg_deadlock_total").increment(1);
                }
                if *code == SqlState::T_R_SERIALIZATION_FAILURE {
                    metrics::counter!("pg_serialization_retry_total").increment(1);
                }
                true
            }
            Some(_) => false,
            // No SQLSTATE: an I/O error or a protocol problem, i.e. the connection is gone.
            None => true,
        }
    };
    let cause = Cause::with_source(text, err);
    if transient {
        TxError::Transient(cause)
    } else {
        TxError::Unknown(cause)
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
        classify(e)
    }
}

impl From<deadpool_postgres::PoolError> for TxError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        match e {
            deadpool_postgres::PoolError::Backend(be) => classify(be),
            other => TxError::Transient(Cause::with_source(other.to_string(), other)),
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

    #[test]
    fn a_cause_keeps_its_source_and_its_words() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "read timed out");
        let err = TxError::Transient(Cause::with_source("connection lost", io));
        assert_eq!(err.to_string(), "transient: connection lost");
        let source = std::error::Error::source(&err).map(|s| s.to_string());
        assert_eq!(source.as_deref(), Some("read timed out"));
        let plain = TxError::Unknown("no outcome".into());
        assert!(std::error::Error::source(&plain).is_none());
        assert_eq!(plain.class(), "unknown");
    }
}
