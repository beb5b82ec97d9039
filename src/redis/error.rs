//! What a failed call to the reservation store was, so that callers can tell a Redis that did
//! not answer in time from a script that refused to run from a cluster moving a slot.

use deadpool_redis::redis::{self, RedisError};

/// Why a call to [`super::RedisStore`] failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No answer within a bound: the connect, the command (`redis.response_timeout_ms`) or the
    /// wait for a pooled connection (`redis.pool_wait_timeout_ms`).
    #[error("redis did not answer in time: {0}")]
    Timeout(String),
    /// No connection: refused, dropped, or the pool is closed.
    #[error("redis is unreachable: {0}")]
    Unavailable(#[source] RedisError),
    /// A cluster moving a slot (MOVED, ASK, TRYAGAIN, CLUSTERDOWN, MASTERDOWN) still did so after
    /// the store's own retries.
    #[error("redis cluster redirected the call: {0}")]
    Redirect(#[source] RedisError),
    /// Redis ran the command and answered with an error (a script error, BUSY, OOM ...).
    #[error("redis refused the call: {0}")]
    Refused(#[source] RedisError),
    /// An answer this build does not understand (a script's unknown code, a wrong type).
    #[error("unexpected answer from redis: {0}")]
    Unexpected(String),
    /// A rebuild of the shard from PostgreSQL held its stock longer than the caller waits
    /// (docs/architecture/redis.md#when-redis-forgets): nothing changed, ask again later.
    #[error("a rebuild holds the shard: {0}")]
    Held(String),
}

impl StoreError {
    /// A short label for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::Redirect(_) => "redirect",
            StoreError::Refused(_) => "refused",
            StoreError::Unexpected(_) => "unexpected",
            StoreError::Held(_) => "held",
        }
    }

    pub(super) fn unexpected(what: impl Into<String>) -> Self {
        StoreError::Unexpected(what.into())
    }
}

impl From<RedisError> for StoreError {
    fn from(e: RedisError) -> Self {
        use redis::ErrorKind::*;
        if e.is_timeout() {
            StoreError::Timeout(e.to_string())
        } else if super::pipeline::redirected(&e) {
            StoreError::Redirect(e)
        } else if e.is_connection_refusal() || e.is_connection_dropped() || e.is_io_error() {
            StoreError::Unavailable(e)
        } else if matches!(e.kind(), TypeError) {
            StoreError::Unexpected(e.to_string())
        } else {
            StoreError::Refused(e)
        }
    }
}

impl From<deadpool::managed::PoolError<RedisError>> for StoreError {
    fn from(e: deadpool::managed::PoolError<RedisError>) -> Self {
        use deadpool::managed::PoolError;
        match e {
            PoolError::Backend(e) => e.into(),
            PoolError::Timeout(t) => {
                StoreError::Timeout(format!("waiting for a pooled connection ({t:?})"))
            }
            other => StoreError::Unavailable(RedisError::from((
                redis::ErrorKind::IoError,
                "the connection pool",
                other.to_string(),
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: redis::ErrorKind, what: &'static str) -> StoreError {
        RedisError::from((kind, what)).into()
    }

    #[test]
    fn each_failure_is_told_apart() {
        assert_eq!(err(redis::ErrorKind::Moved, "MOVED").kind(), "redirect");
        assert_eq!(
            err(redis::ErrorKind::ClusterDown, "CLUSTERDOWN").kind(),
            "redirect"
        );
        assert_eq!(
            err(redis::ErrorKind::ResponseError, "ERR script").kind(),
            "refused"
        );
        assert_eq!(
            err(redis::ErrorKind::TypeError, "not an int").kind(),
            "unexpected"
        );
        let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer");
        assert_eq!(
            StoreError::from(RedisError::from(timed_out)).kind(),
            "timeout"
        );
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(
            StoreError::from(RedisError::from(refused)).kind(),
            "unavailable"
        );
        let waited: deadpool::managed::PoolError<RedisError> =
            deadpool::managed::PoolError::Timeout(deadpool::managed::TimeoutType::Wait);
        assert_eq!(StoreError::from(waited).kind(), "timeout");
    }
}
