//! DLQ intake: one consumer per group's `%DLQ%` topic records every message that group gave up
//! on in PostgreSQL for an operator (`seckill dlq`), and keeps the DLQ gauges current.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::config::Settings;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::dlq;
use crate::services::failure_groups::{failure_groups, FailureGroup};

/// Records the dead letters of one group.
pub struct DlqIntake {
    pub pool: deadpool_postgres::Pool,
    /// The group whose `%DLQ%` topic this consumes.
    pub source_group: String,
    /// The topic that group consumes (the dead letters' original topic).
    pub source_topic: String,
}

#[async_trait::async_trait]
impl BatchHandler for DlqIntake {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let client = match self.pool.get().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "DLQ intake cannot reach PostgreSQL; will be redelivered");
                return ConsumeDecision::Retry;
            }
        };
        for d in &batch {
            match dlq::intake(&**client, &self.source_group, &self.source_topic, d).await {
                Ok(true) => {
                    metrics::counter!("mq_dlq_intake_total").increment(1);
                    error!(
                        consumer_group = %self.source_group, topic = %self.source_topic,
                        message_id = d.properties.get("message_id").unwrap_or(""),
                        reservation_id = d.properties.get("reservation_id").unwrap_or(""),
                        order_id = d.properties.get("order_id").unwrap_or(""),
                        "message dead-lettered after its last retry; recorded for an operator"
                    );
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %e, "DLQ intake failed; will be redelivered");
                    return ConsumeDecision::Retry;
                }
            }
        }
        ConsumeDecision::Ack
    }
}

/// Starts one intake consumer per group with dead letters.
pub async fn start_intakes(
    settings: &Settings,
    pool: deadpool_postgres::Pool,
) -> anyhow::Result<Vec<crate::mq::ConsumerHandle>> {
    let names = settings.names();
    let mut handles = Vec::new();
    for (group, topic) in names.dead_letter_sources() {
        let intake = std::sync::Arc::new(DlqIntake {
            pool: pool.clone(),
            source_group: group.clone(),
            source_topic: topic,
        });
        let intake_group = names.dlq_intake_group_of(&group);
        handles.push(
            crate::mq::start_consumer(
                settings,
                &intake_group,
                &crate::mq::Names::dlq_topic(&group),
                intake,
                settings.consumer.dlq_intake_workers,
                16,
            )
            .await?,
        );
    }
    Ok(handles)
}

/// Keeps `mq_dlq_messages` and `mq_dlq_oldest_age_seconds` current until `shutdown`.
pub async fn run_gauges(
    pool: deadpool_postgres::Pool,
    tickets: Option<crate::services::tickets::Tickets>,
    shutdown: CancellationToken,
) {
    let mut groups = GroupGauges::default();
    while !shutdown.is_cancelled() {
        // Fault-injection point: a loop that dies (`consume-dlq-gauges-loop=panic`).
        fail::fail_point!("consume-dlq-gauges-loop");
        if let Ok(client) = pool.get().await {
            if let Ok((open, oldest)) = dlq::open_stats(&**client).await {
                metrics::gauge!("mq_dlq_messages").set(open as f64);
                metrics::gauge!("mq_dlq_oldest_age_seconds").set(oldest);
            }
            if let Ok(found) = failure_groups(&client, None, GROUPS_SCAN).await {
                groups.export(&found);
                if let Some(t) = &tickets {
                    if let Err(e) = t.pass(&client, &found).await {
                        warn!(error = %e, "ticket pass failed; tried again in 5 s");
                    }
                }
            }
            // Replays run from the short-lived CLI, which nothing scrapes: the audit table is
            // the record, and this long-running role exports it as a counter.
            if let Ok(counts) = dlq::replay_counts(&**client).await {
                for (result, n) in counts {
                    metrics::counter!("mq_dlq_replay_total", "result" => result)
                        .absolute(n.max(0) as u64);
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

/// Rows of each table the per-group gauge reads at most.
const GROUPS_SCAN: i64 = 5_000;

/// Groups exported by fingerprint; the rest are summed under `fingerprint="other"`, so the
/// series stay bounded however many ways things fail.
const GROUPS_EXPORTED: usize = 10;

/// `mq_dlq_group_messages{fingerprint, consumer_group, source}`: each open group of failures
/// (`seckill dlq groups`), the largest [`GROUPS_EXPORTED`] by fingerprint. A group that is gone
/// (replayed, discarded) is set to 0 once, then forgotten.
#[derive(Default)]
struct GroupGauges {
    exported: std::collections::BTreeSet<(String, String, &'static str)>,
}

impl GroupGauges {
    fn export(&mut self, groups: &[FailureGroup]) {
        let mut now = std::collections::BTreeSet::new();
        let mut other: std::collections::BTreeMap<(String, &'static str), usize> =
            Default::default();
        for (i, g) in groups.iter().enumerate() {
            if i < GROUPS_EXPORTED {
                let key = (g.fingerprint.clone(), g.consumer_group.clone(), g.source);
                set_group(&key, g.count);
                now.insert(key);
            } else {
                *other
                    .entry((g.consumer_group.clone(), g.source))
                    .or_default() += g.count;
            }
        }
        for ((group, source), n) in other {
            let key = ("other".to_string(), group, source);
            set_group(&key, n);
            now.insert(key);
        }
        for gone in self.exported.difference(&now) {
            set_group(gone, 0);
        }
        self.exported = now;
    }
}

fn set_group((fingerprint, group, source): &(String, String, &'static str), n: usize) {
    metrics::gauge!("mq_dlq_group_messages", "fingerprint" => fingerprint.clone(),
        "consumer_group" => group.clone(), "source" => *source)
    .set(n as f64);
}
