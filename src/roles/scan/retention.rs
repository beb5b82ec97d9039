//! Retention: settled bookkeeping rows (inbox, outbox, tasks) past their retention are deleted
//! in small batches, every `retention.interval_secs` (the rules are in `pg::retention`); and
//! every minute, how big the growing tables are (`pg::table_sizes`).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::archive::Archive;
use crate::config::RetentionSettings;
use crate::pg::retention::RetentionError;

/// Starts the retention passes and the table sizes on the role's retention connection (the
/// sizes share it: a minute's read waits out a pass); returns their tasks, retention first.
pub(super) async fn start(
    settings: &crate::config::Settings,
    watchdog: &crate::shutdown::Watchdog,
    shutdown: &CancellationToken,
) -> anyhow::Result<(tokio::task::JoinHandle<()>, tokio::task::JoinHandle<()>)> {
    let pool =
        crate::pg::connect_pool(&settings.pg, crate::config::budget::pools::SCAN_RETENTION).await?;
    let rt = settings.retention.clone();
    let sizes = sizes_loop(pool.clone(), rt.clone(), shutdown.clone());
    let sizes = watchdog.spawn("table_sizes", sizes);
    let archive = Archive::of(settings);
    let passes = run_loop(
        pool,
        archive,
        rt,
        settings.pg.statement_timeout_ms,
        shutdown.clone(),
    );
    Ok((watchdog.spawn("retention", passes), sizes))
}

/// One retention pass every `rt.interval_secs` until `stop`.
async fn run_loop(
    pool: deadpool_postgres::Pool,
    archive: Archive,
    rt: RetentionSettings,
    statement_timeout_ms: u64,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        if let Ok(mut client) = pool.get().await {
            match crate::pg::retention::pass(&mut client, &archive, &rt, statement_timeout_ms).await
            {
                Ok(done) => {
                    metrics::gauge!("retention_last_success_timestamp_seconds")
                        .set(chrono::Utc::now().timestamp() as f64);
                    info!(archived_and_deleted = ?done, "retention pass")
                }
                Err(e) => {
                    // The connection may hold the long bound: it leaves the pool.
                    drop(deadpool_postgres::Object::take(client));
                    let reason = match &e {
                        RetentionError::Archive(_) => "archive",
                        RetentionError::Pg(_) => "postgres",
                    };
                    metrics::counter!("retention_failures_total", "reason" => reason).increment(1);
                    warn!(error = %e, reason, "retention pass failed: nothing unarchived was deleted")
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(Duration::from_secs(rt.interval_secs)) => {}
        }
    }
}

/// How often the growing tables' sizes are read.
const SIZES_EVERY: Duration = Duration::from_secs(60);

/// Every [`SIZES_EVERY`] until `stop`: `pg_table_bytes{table}`, `pg_table_rows_estimate{table}`
/// and, for each table partitioned by day, its oldest partition's age and how far retention is
/// behind on it, for the operator watching the tables grow.
async fn sizes_loop(pool: deadpool_postgres::Pool, rt: RetentionSettings, stop: CancellationToken) {
    while !stop.is_cancelled() {
        if let Ok(client) = pool.get().await {
            if let Err(e) = export_sizes(&client, &rt).await {
                warn!(error = %crate::pg::errors::classify(e), "table sizes not read");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(SIZES_EVERY) => {}
        }
    }
}

async fn export_sizes(
    client: &tokio_postgres::Client,
    rt: &RetentionSettings,
) -> Result<(), tokio_postgres::Error> {
    use crate::pg::table_sizes;
    for t in table_sizes::growing(client).await? {
        metrics::gauge!("pg_table_bytes", "table" => t.table).set(t.bytes as f64);
        metrics::gauge!("pg_table_rows_estimate", "table" => t.table).set(t.rows as f64);
    }
    for (rule, age) in crate::pg::retention::by_day(rt) {
        let oldest = table_sizes::oldest_day_partition_age_secs(client, rule.table).await?;
        let oldest = oldest.unwrap_or(0.0);
        metrics::gauge!("pg_partition_oldest_age_seconds", "table" => rule.table).set(oldest);
        metrics::gauge!("retention_lag_seconds", "table" => rule.table)
            .set(table_sizes::retention_lag_secs(oldest, age));
    }
    Ok(())
}
