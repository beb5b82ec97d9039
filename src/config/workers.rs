//! `[consumer]`, `[scan]`, `[timeout]`, `[retention]` and `[telemetry]`: the background roles'
//! sizes, bounds and intervals.

use std::net::SocketAddr;

use serde::Deserialize;

use super::ConfigError;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerSettings {
    /// Messages handed to one listener call, and at most per PostgreSQL transaction (calls are
    /// gathered into shared transactions up to this size).
    pub batch_size: usize,
    /// Order-create listener calls in flight at once (`consume --workers` overrides it): the
    /// batches the gathering sees together. Past the worker budget they wait in memory.
    pub listener_calls: usize,
    /// How long an order transaction that is not full waits for more calls to join it
    /// (docs/architecture/order-creation.md#gathering-batches-across-queues); 0: natural batching
    /// only.
    pub gather_wait_ms: u64,
    /// One transaction per stock bucket
    /// (docs/architecture/order-creation.md#gathering-batches-across-queues): a listener call's
    /// messages are split by their reservation's bucket and each bucket's are gathered apart, so K
    /// stock rows are locked by K transactions side by side. Off: a transaction gathers every
    /// bucket's messages (and locks all their rows).
    pub bucket_lanes: bool,
    /// Peak shaving inside the consumer (docs/architecture/roles.md#pacing-during-a-burst): while
    /// the first waiting reservation is younger than this, one order transaction runs at a time and
    /// the backlog waits, leaving the CPU to the roles that answer buyers; past it the adaptive
    /// limit applies in full. 0: off.
    pub pace_age_ms: u64,
    /// The adaptive limit of order transactions in flight shrinks when a transaction takes
    /// longer than this (begin to commit)...
    pub tx_latency_target_ms: u64,
    /// ...or waits longer than this for a pooled connection; it grows back while both hold.
    pub pool_wait_target_ms: u64,
    /// Bound on one order transaction, begin to commit: past it the connection is dropped and
    /// the batch retried (each statement is already bounded by `pg.statement_timeout_ms`).
    pub tx_timeout_ms: u64,
    /// Broker redeliveries before a message goes to the DLQ.
    pub max_reconsume_times: i32,
    /// Where `consume` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// Seconds to let in-flight transactions finish on SIGTERM.
    pub shutdown_grace_secs: u64,
    /// Seconds an order stays unpaid before the timeout cancel may take it back.
    pub pay_window_secs: u64,
    /// Listener calls in flight at once and messages per call of the other groups of the
    /// `consume` role (compensation, projection, DLQ intake); each call is one pooled
    /// connection's work, outside the order worker budget.
    pub compensate_workers: usize,
    pub compensate_batch_size: usize,
    pub projection_workers: usize,
    pub projection_batch_size: usize,
    pub dlq_intake_workers: usize,
    /// The audit group (docs/architecture/messages.md#the-audit-stream): listener calls in
    /// flight (0: the group does not run in this process) and messages per call.
    #[serde(default = "default_audit_workers")]
    pub audit_workers: usize,
    #[serde(default = "default_audit_batch_size")]
    pub audit_batch_size: usize,
    /// Non-core work steps aside while orders are behind
    /// (docs/architecture/recovery.md#projection): the projection holds its batches while the
    /// order-create backlog's oldest message is older than this many seconds, until it is back
    /// under half of it (0: never).
    #[serde(default)]
    pub projection_defer_lag_secs: u64,
    /// The fast lane (docs/architecture/roles.md#the-fast-lane): once the messages handed over are
    /// this many milliseconds old (the consumer is that far behind), those whose reservation
    /// has less than `fast_lane_margin_ms` of its validity left are rejected and compensated
    /// ahead of the queue instead of waiting for an order they could not get (0: off).
    #[serde(default)]
    pub fast_lane_backlog_ms: u64,
    #[serde(default = "default_fast_lane_margin_ms")]
    pub fast_lane_margin_ms: u64,
}

fn default_audit_workers() -> usize {
    1
}

fn default_audit_batch_size() -> usize {
    32
}

fn default_fast_lane_margin_ms() -> u64 {
    2_000
}

impl ConsumerSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        // A listener call carries at most one pull, which the broker caps at 32 messages (its
        // default maxTransferCountOnMessageInMemory): above 32 a transaction gathers calls
        // (docs/architecture/order-creation.md#gathering-batches-across-queues).
        if self.batch_size == 0 || self.batch_size > 64 {
            return Err(invalid("consumer.batch_size", "must be in 1..=64"));
        }
        // Listener calls in flight (order-create at most 128 of the process's 160 slots, the
        // other groups 64 each) and messages per call (at most the client's 32).
        for (key, value, max) in [
            ("consumer.listener_calls", self.listener_calls, 128),
            ("consumer.compensate_workers", self.compensate_workers, 64),
            ("consumer.projection_workers", self.projection_workers, 64),
            ("consumer.dlq_intake_workers", self.dlq_intake_workers, 64),
            (
                "consumer.compensate_batch_size",
                self.compensate_batch_size,
                32,
            ),
            (
                "consumer.projection_batch_size",
                self.projection_batch_size,
                32,
            ),
            ("consumer.audit_batch_size", self.audit_batch_size, 32),
        ] {
            if value == 0 || value > max {
                return Err(ConfigError::invalid(key, format!("must be in 1..={max}")));
            }
        }
        if self.audit_workers > 64 {
            return Err(invalid(
                "consumer.audit_workers",
                "must be in 0..=64 (0: not run)",
            ));
        }
        if self.gather_wait_ms > 1_000 {
            // The wait comes out of every order's reservation->order time (SLO 3 s).
            return Err(invalid("consumer.gather_wait_ms", "must be at most 1000"));
        }
        if self.pace_age_ms > 2_000 {
            // Held this long, an order still has the rest of its 3 s SLO to be created.
            return Err(invalid("consumer.pace_age_ms", "must be at most 2000"));
        }
        if self.tx_latency_target_ms == 0 {
            return Err(invalid("consumer.tx_latency_target_ms", "must be positive"));
        }
        if self.pool_wait_target_ms == 0 {
            return Err(invalid("consumer.pool_wait_target_ms", "must be positive"));
        }
        if self.max_reconsume_times < 0 {
            return Err(invalid(
                "consumer.max_reconsume_times",
                "must not be negative",
            ));
        }
        if self.pay_window_secs == 0 {
            return Err(invalid("consumer.pay_window_secs", "must be positive"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScanSettings {
    /// Where `scan` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// Reservations one scanner leases per activity and pass.
    pub scanner_batch: usize,
    /// How long a scanner owns what it claimed; a dead scanner's claims return after it.
    pub scanner_lease_ms: u64,
    /// Pause between scanner passes when nothing was due.
    pub scanner_poll_ms: u64,
    /// Cap of the re-send backoff (it starts at `api.resend_backoff_ms` and doubles).
    pub resend_backoff_cap_ms: u64,
    /// How long after its validity a refused, uncertain reservation waits before it is settled
    /// from PostgreSQL (docs/architecture/hot-path.md#uncertain-sends).
    pub settle_grace_ms: u64,
    /// A confirmed send the consumers have not taken this long after the group's progress
    /// on the brokers that answer is sent again
    /// (docs/architecture/messages.md#a-dead-brokers-messages); 0: never.
    pub unconsumed_resend_ms: u64,
    /// How often the scanner looks for activities fenced after Redis lost writes, and rebuilds
    /// those whose backlog has drained (docs/architecture/redis.md#when-redis-forgets).
    pub resync_poll_ms: u64,
    /// Outbox rows one relay claims at a time.
    pub relay_batch: usize,
    /// How long a relay owns the rows it claimed before another may send them again.
    pub relay_lease_secs: u64,
    /// Attempts before an outbox row is marked DEAD (alert, operator).
    pub relay_max_attempts: i32,
    /// Fallback poll when no NOTIFY arrives.
    pub relay_poll_ms: u64,
    /// A timer (CANCEL_IF_UNPAID, due at the order's payment deadline) waits in the outbox
    /// until this long before it is due, then the relay sends it
    /// (docs/architecture/recovery.md#outbox-relay): a burst's timers leave the broker alone while
    /// the burst lasts. Written into the outbox row by the order transaction.
    pub timer_lead_secs: u64,
    pub relay_backoff_base_ms: u64,
    pub relay_backoff_cap_ms: u64,
    /// Sends in flight at once (scanner and relay each).
    pub send_concurrency: usize,
    pub shutdown_grace_secs: u64,
}

impl ScanSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        if self.scanner_batch == 0 || self.scanner_batch > 10_000 {
            return Err(invalid("scan.scanner_batch", "must be in 1..=10000"));
        }
        if self.scanner_lease_ms < 100 {
            return Err(invalid("scan.scanner_lease_ms", "must be at least 100"));
        }
        if self.resync_poll_ms < 100 || self.resync_poll_ms > 60_000 {
            return Err(invalid("scan.resync_poll_ms", "must be in 100..=60000"));
        }
        if self.scanner_poll_ms == 0 || self.relay_poll_ms == 0 {
            return Err(invalid(
                "scan.scanner_poll_ms",
                "poll intervals must be positive",
            ));
        }
        if self.settle_grace_ms > 3_600_000 {
            return Err(invalid(
                "scan.settle_grace_ms",
                "must be at most 3600000 (an hour): the unit is held that long",
            ));
        }
        if self.timer_lead_secs < 10 {
            // The broker's timer wheel delivers seconds late (BENCHMARKS.md), and a send may
            // need a retry: a lead shorter than that would make every timer late.
            return Err(invalid("scan.timer_lead_secs", "must be at least 10"));
        }
        if self.relay_batch == 0 || self.relay_batch > 10_000 {
            return Err(invalid("scan.relay_batch", "must be in 1..=10000"));
        }
        if self.relay_lease_secs == 0 {
            return Err(invalid("scan.relay_lease_secs", "must be positive"));
        }
        if self.relay_max_attempts < 1 {
            return Err(invalid("scan.relay_max_attempts", "must be at least 1"));
        }
        if self.relay_backoff_base_ms == 0 || self.relay_backoff_cap_ms < self.relay_backoff_base_ms
        {
            return Err(invalid(
                "scan.relay_backoff_cap_ms",
                "must be >= scan.relay_backoff_base_ms > 0",
            ));
        }
        if self.send_concurrency == 0 {
            return Err(invalid("scan.send_concurrency", "must be at least 1"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutSettings {
    /// Where `timeout-cancel` serves /metrics, /healthz, /readyz.
    pub metrics_listen: SocketAddr,
    /// The second trigger: an order still unpaid this long after its deadline (its timer is
    /// late or lost) is cancelled by the sweep over `orders`
    /// (docs/architecture/recovery.md#timeout-cancel-and-payment).
    pub sweep_grace_ms: u64,
    /// How often the sweep looks.
    pub sweep_interval_ms: u64,
}

impl TimeoutSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.sweep_interval_ms == 0 {
            return Err(ConfigError::invalid(
                "timeout.sweep_interval_ms",
                "must be positive",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    /// Days inbox rows are kept (fractions allowed: 0.5 = 12 h). A replay of a message older
    /// than this could slip past the inbox and apply twice, so `dlq replay` refuses it unless
    /// forced.
    pub inbox_days: f64,
    /// Days SENT outbox rows are kept (PENDING and DEAD rows are never purged).
    pub outbox_days: f64,
    pub quarantine_days: f64,
    /// Days REPLAYED / DISCARDED dead letters are kept (OPEN ones are never purged).
    pub dlq_days: f64,
    /// Hours an activity's Redis keys (stock, buyers, request ids, indexes) live once the
    /// scanner has retired the activity (ended, nothing pending): long enough for the
    /// reconcile window (`seckill reconcile --window-hours`, 24 by default) to still compare
    /// them with PostgreSQL.
    pub activity_keys_hours: u32,
    /// After each pass, `VACUUM (ANALYZE)` the pipeline's busy tables. For a database that
    /// runs without autovacuum (such as this project's CI machines): dead rows from status
    /// updates and purges are otherwise never reclaimed, and every scan wades through them.
    /// Leave it off where autovacuum runs.
    pub vacuum: bool,
    /// Rows deleted per statement: small enough to never hold locks for long. Each batch is
    /// one archive segment.
    pub batch: i64,
    /// Days the audit record's day partitions are kept before they are archived and dropped
    /// whole (counted from the end of the partition's day).
    pub audit_days: f64,
    /// Where rows go before retention takes them out of PostgreSQL: `<archive_dir>/<env>/...`
    /// (docs/architecture/postgresql.md#the-archive). A relative path is read from the role's
    /// working directory; production points it at a mounted volume or an object-store mount.
    pub archive_dir: String,
    /// Rows per archive segment when a whole partition is archived.
    pub archive_segment_rows: i64,
    /// How often `scan` runs the purge.
    pub interval_secs: u64,
}

impl RetentionSettings {
    /// A retention in days as a duration.
    pub fn age(days: f64) -> std::time::Duration {
        std::time::Duration::from_secs_f64(days.max(0.0) * 86_400.0)
    }
}

impl RetentionSettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid;
        for (key, days) in [
            ("retention.inbox_days", self.inbox_days),
            ("retention.outbox_days", self.outbox_days),
            ("retention.quarantine_days", self.quarantine_days),
            ("retention.dlq_days", self.dlq_days),
            ("retention.audit_days", self.audit_days),
        ] {
            if !(days.is_finite() && days > 0.0 && days <= 36_500.0) {
                return Err(invalid(key, "must be a positive number of days"));
            }
        }
        if self.batch <= 0 || self.batch > 100_000 {
            return Err(invalid("retention.batch", "must be in 1..=100000"));
        }
        if self.interval_secs == 0 {
            return Err(invalid("retention.interval_secs", "must be positive"));
        }
        if self.archive_dir.trim().is_empty() {
            return Err(invalid(
                "retention.archive_dir",
                "must name a directory: rows are archived before retention deletes them",
            ));
        }
        if self.archive_segment_rows <= 0 || self.archive_segment_rows > 1_000_000 {
            return Err(invalid(
                "retention.archive_segment_rows",
                "must be in 1..=1000000",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    /// `tracing` filter directive, e.g. `info,seckill=debug`.
    pub log_level: String,
    /// JSON lines instead of human-readable logs.
    pub json: bool,
}

impl TelemetrySettings {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            return Err(ConfigError::invalid(
                "telemetry.log_level",
                "is not a valid filter directive",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ConfigError;

    /// A transaction gathers up to two pulls of 32 (the broker's cap): 64 starts, 65 names the key.
    #[test]
    fn an_order_batch_is_one_to_sixty_four_messages() {
        let mut consumer = super::super::tests::test_settings().consumer;
        for size in [1, 32, 64] {
            consumer.batch_size = size;
            assert!(consumer.validate().is_ok(), "batch_size {size} refused");
        }
        for size in [0, 65] {
            consumer.batch_size = size;
            assert!(
                matches!(
                    consumer.validate(),
                    Err(ConfigError::Invalid {
                        key: "consumer.batch_size",
                        ..
                    })
                ),
                "batch_size {size} accepted"
            );
        }
    }
}
