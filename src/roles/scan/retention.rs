//! Retention: settled bookkeeping rows (inbox, outbox, tasks) past their retention are deleted
//! in small batches, every `retention.interval_secs` (the rules are in `pg::retention`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::RetentionSettings;

/// Bound on each statement of a retention pass (a batch DELETE, a VACUUM).
const RETENTION_STATEMENT_TIMEOUT_SECS: u64 = 600;

/// One retention pass every `rt.interval_secs` until `stop`.
pub(super) async fn run_loop(
    pool: deadpool_postgres::Pool,
    rt: RetentionSettings,
    statement_timeout_ms: u64,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Ok(client) = pool.get().await {
            // Its statements are not the hot path's: a batch DELETE on a big table, or a
            // VACUUM, may take longer than pg.statement_timeout_ms (it failed every pass of
            // make soak with the 2 s bound). The connection gets its bound back afterwards.
            let pass = async {
                crate::pg::set_statement_timeout(&**client, RETENTION_STATEMENT_TIMEOUT_SECS)
                    .await?;
                let done = crate::pg::retention::purge_all(&**client, &rt).await;
                crate::pg::reset_statement_timeout(&**client, statement_timeout_ms).await?;
                done
            };
            match pass.await {
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
