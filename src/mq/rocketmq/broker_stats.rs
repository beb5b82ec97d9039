//! The brokers' own health (docs/architecture/observability.md#broker-health), read through the
//! admin API (`getBrokerRuntimeInfo`) from each master serving a topic: how full the commit log's
//! disk is, whether the store takes writes, how long a synchronous flush has waited, how far the
//! replicas are behind and how many are in sync. The scanner exports them as gauges labelled by
//! broker address; the alert rules read them.

use std::collections::HashMap;

use super::LagProbe;

/// One master's health, from its runtime table; `None` where the broker did not say.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BrokerStats {
    /// Used share (0-1) of the commit log's disk, the fullest of its paths.
    pub disk_used_ratio: Option<f64>,
    /// The store accepts writes (false: a full disk, a flush error, shutting down).
    pub writeable: Option<bool>,
    /// The OS page cache is busy: the broker is refusing or slowing sends.
    pub page_cache_busy: Option<bool>,
    /// The last flush failed.
    pub flush_error: Option<bool>,
    /// How long the oldest synchronous flush request has waited, in milliseconds.
    pub sync_flush_oldest_wait_ms: Option<f64>,
    /// How long the put lock has been held by the current write, in milliseconds.
    pub put_lock_ms: Option<f64>,
    /// Bytes the furthest replica is behind the master.
    pub replica_lag_bytes: Option<f64>,
    /// Members of the in-sync set, the master included.
    pub in_sync_replicas: Option<f64>,
}

impl BrokerStats {
    /// Reads the keys this project watches out of a runtime table (pure).
    pub fn from_table(t: &HashMap<String, String>) -> Self {
        let num = |k: &str| t.get(k).and_then(|v| v.trim().parse::<f64>().ok());
        let flag = |k: &str| t.get(k).and_then(|v| v.trim().parse::<bool>().ok());
        Self {
            // A path that does not exist reads -1: no figure.
            disk_used_ratio: num("commitLogDiskRatio").filter(|r| (0.0..=1.0).contains(r)),
            writeable: flag("storeWriteable"),
            page_cache_busy: flag("storeOsPageCacheBusy"),
            flush_error: flag("storeLastFlushError"),
            sync_flush_oldest_wait_ms: num("storeSyncFlushOldestWaitMillis"),
            put_lock_ms: num("pageCacheLockTimeMills"),
            replica_lag_bytes: num("haMaxReplicaLagBytes"),
            in_sync_replicas: num("haSyncStateSetSize"),
        }
    }

    /// The gauges and their values, for what the broker said.
    pub fn gauges(&self) -> Vec<(&'static str, f64)> {
        let bit = |b: bool| if b { 1.0 } else { 0.0 };
        [
            ("mq_broker_disk_used_ratio", self.disk_used_ratio),
            ("mq_broker_writeable", self.writeable.map(bit)),
            ("mq_broker_page_cache_busy", self.page_cache_busy.map(bit)),
            ("mq_broker_flush_error", self.flush_error.map(bit)),
            (
                "mq_broker_sync_flush_wait_seconds",
                self.sync_flush_oldest_wait_ms.map(|ms| ms / 1000.0),
            ),
            (
                "mq_broker_put_lock_seconds",
                self.put_lock_ms.map(|ms| ms / 1000.0),
            ),
            ("mq_broker_replica_lag_bytes", self.replica_lag_bytes),
            ("mq_broker_in_sync_replicas", self.in_sync_replicas),
        ]
        .into_iter()
        .filter_map(|(name, v)| Some((name, v?)))
        .collect()
    }
}

impl LagProbe {
    /// Each master serving `topic`, with its health or why it could not be read.
    pub async fn broker_stats(
        &self,
        topic: &str,
    ) -> anyhow::Result<Vec<(String, anyhow::Result<BrokerStats>)>> {
        let brokers = self.topic_brokers(topic).await?;
        let mut out = Vec::with_capacity(brokers.len());
        for addr in brokers.iter() {
            let stats = self
                .runtime_table(addr)
                .await
                .map(|t| BrokerStats::from_table(&t));
            out.push((addr.to_string(), stats));
        }
        Ok(out)
    }
}

/// Reads every master serving `topic` and sets its gauges (`broker` = its address); a broker
/// that does not answer counts in `mq_broker_stats_read_errors_total` and keeps its last
/// values (its `up` is the alert's business: SeckillBrokerHoldingMessages, the sends' errors).
pub async fn export_broker_stats(probe: &LagProbe, topic: &str) {
    let read = match probe.broker_stats(topic).await {
        Ok(read) => read,
        Err(e) => {
            metrics::counter!("mq_broker_stats_read_errors_total", "broker" => "route")
                .increment(1);
            tracing::debug!(topic, error = %e, "broker stats: no route");
            return;
        }
    };
    for (broker, stats) in read {
        match stats {
            Ok(stats) => {
                for (name, value) in stats.gauges() {
                    metrics::gauge!(name, "broker" => broker.clone()).set(value);
                }
            }
            Err(e) => {
                metrics::counter!("mq_broker_stats_read_errors_total", "broker" => broker.clone())
                    .increment(1);
                tracing::debug!(%broker, error = %e, "broker stats unreadable");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_table_reads_into_the_figures_watched() {
        let table: HashMap<String, String> = [
            ("commitLogDiskRatio", "0.8123"),
            ("commitLogDiskRatio_/data/store/commitlog", "0.8123"),
            ("storeWriteable", "true"),
            ("storeOsPageCacheBusy", "false"),
            ("storeLastFlushError", "false"),
            ("storeSyncFlushOldestWaitMillis", "1500"),
            ("pageCacheLockTimeMills", "0"),
            ("haMaxReplicaLagBytes", "1048576"),
            ("haSyncStateSetSize", "2"),
            ("remainHowManyDataToFlush", "1.2 KiB"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = BrokerStats::from_table(&table);
        assert_eq!(s.disk_used_ratio, Some(0.8123));
        assert_eq!(
            (s.writeable, s.page_cache_busy, s.flush_error),
            (Some(true), Some(false), Some(false))
        );
        let g: HashMap<&str, f64> = s.gauges().into_iter().collect();
        assert_eq!(g["mq_broker_sync_flush_wait_seconds"], 1.5);
        assert_eq!(g["mq_broker_replica_lag_bytes"], 1_048_576.0);
        assert_eq!(g["mq_broker_in_sync_replicas"], 2.0);
        assert_eq!(g["mq_broker_writeable"], 1.0);
    }

    #[test]
    fn what_the_broker_does_not_say_is_not_exported() {
        // A store path that does not exist reads -1; no HA service: no replica figures.
        let table: HashMap<String, String> =
            [("commitLogDiskRatio", "-1"), ("storeWriteable", "false")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let g: HashMap<&str, f64> = BrokerStats::from_table(&table)
            .gauges()
            .into_iter()
            .collect();
        assert_eq!(g.len(), 1, "{g:?}");
        assert_eq!(g["mq_broker_writeable"], 0.0);
    }
}
