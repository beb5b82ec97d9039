//! Retention: settled bookkeeping rows (inbox, outbox, tasks) past their retention are deleted
//! in small batches, every `retention.interval_secs` (the rules are in `pg::retention`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::RetentionSettings;

/// One retention pass every `rt.interval_secs` until `stop`.
pub(super) async fn run_loop(
    pool: deadpool_postgres::Pool,
    rt: RetentionSettings,
    statement_timeout_ms: u64,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Ok(client) = pool.get().await {
            match crate::pg::retention::pass(&**client, &rt, statement_timeout_ms).await {
                Ok(done) => info!(deleted = ?done, "retention pass"),
                Err(e) => {
                    // The connection may hold the long bound: it leaves the pool.
                    drop(deadpool_postgres::Object::take(client));
                    warn!(error = %crate::pg::errors::classify(e), "retention pass failed")
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_secs(rt.interval_secs)) => {}
        }
    }
}
