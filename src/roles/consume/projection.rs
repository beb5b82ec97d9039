//! Order-event projection (runs inside `seckill consume`, group
//! `CG_SECKILL_ORDER_QUERY_PROJECTION_V1`): keeps the buyer-facing status of each reservation
//! in Redis from ORDER_CREATED / ORDER_PAID / ORDER_CANCELED. Each event carries the order's
//! `aggregate_version`, its place in the order's sequence: the Lua script applies the next one
//! only, so a duplicate or a stale replay is a no-op, and one that arrives before its order's
//! earlier event is held until that event comes, bounded by one redelivery, after which
//! PostgreSQL's state is projected (docs/architecture/messages.md#event-ordering). A delivered
//! batch is one pipelined round trip.

use chrono::Utc;
use tracing::{debug, info};

use crate::domain::events::OrderEventHeader;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::redis::RedisStore;

use crate::services::poison;

/// How long a projection outlives its last update (buyers poll for minutes, not weeks).
pub const PROJECTION_TTL_SECS: u64 = 7 * 24 * 3600;

pub struct ProjectionHandler {
    pub redis: RedisStore,
    pub pool: deadpool_postgres::Pool,
    pub group: String,
    /// Steps aside while orders are behind (`consumer.projection_defer_lag_secs`).
    pub deferral: Option<std::sync::Arc<super::deferral::Deferral>>,
}

/// How long a batch whose event skipped a version waits, in the process, for the earlier event
/// another worker may be applying at that moment, before the broker is asked to hold it.
const GAP_WAIT: std::time::Duration = std::time::Duration::from_millis(300);

impl ProjectionHandler {
    /// Applies a batch of events in each order's sequence (sorted by order and version, so an
    /// ORDER_PAID ahead of its ORDER_CREATED in one batch waits for it): per message `applied`,
    /// `stale`, `quarantined`, `held` (it skips a version not yet applied: the batch goes back to
    /// the broker, and comes back after its retry delay) or `from_postgres` (still skipping on
    /// its redelivery: PostgreSQL's state of the order is projected instead, which is never
    /// behind the event). `Err` = retry the batch (re-applying is a no-op).
    pub async fn process(&self, batch: &[Delivery]) -> anyhow::Result<Vec<&'static str>> {
        let mut labels: Vec<&'static str> = vec!["quarantined"; batch.len()];
        let mut events: Vec<(usize, OrderEventHeader)> =
            poison::decode_each(&self.pool, &self.group, batch).await?;
        events.sort_by(|(_, a), (_, b)| {
            (&a.order_id, a.aggregate_version).cmp(&(&b.order_id, b.aggregate_version))
        });
        let mut gaps = self.apply(&events, &mut labels).await?;
        if !gaps.is_empty() {
            tokio::time::sleep(GAP_WAIT).await;
            let again: Vec<(usize, OrderEventHeader)> =
                gaps.iter().map(|&g| events[g].clone()).collect();
            gaps = self
                .apply(&again, &mut labels)
                .await?
                .into_iter()
                .map(|g| gaps[g])
                .collect();
        }
        for g in gaps {
            let (i, event) = &events[g];
            labels[*i] = if batch[*i].reconsume_times == 0 {
                "held"
            } else {
                self.project_postgres_state(event).await?
            };
            metrics::counter!("projection_apply_total", "result" => labels[*i]).increment(1);
            info!(order_id = %event.order_id, version = event.aggregate_version,
                  result = labels[*i], "order event skipped a version");
        }
        Ok(labels)
    }

    /// Applies `events` in order, labelling each; returns the positions (in `events`) of those
    /// that skipped a version.
    async fn apply(
        &self,
        events: &[(usize, OrderEventHeader)],
        labels: &mut [&'static str],
    ) -> anyhow::Result<Vec<usize>> {
        let headers: Vec<&OrderEventHeader> = events.iter().map(|(_, e)| e).collect();
        let results = self
            .redis
            .projections()
            .project_many(
                &headers,
                PROJECTION_TTL_SECS,
                Utc::now().timestamp_millis(),
                true,
            )
            .await?;
        let mut gaps = Vec::new();
        for (k, ((i, event), r)) in events.iter().zip(&results).enumerate() {
            let label = match r.as_str() {
                "APPLIED" => "applied",
                "GAP" => {
                    gaps.push(k);
                    continue;
                }
                _ => "stale",
            };
            metrics::counter!("projection_apply_total", "result" => label).increment(1);
            debug!(order_id = %event.order_id, version = event.aggregate_version,
                   status = %event.status, result = label, "order event projected");
            labels[*i] = label;
        }
        Ok(gaps)
    }

    /// Projects the order as PostgreSQL has it, whatever version the projection holds. An
    /// order PostgreSQL does not have is an error: the batch is retried, and dead-lettered after
    /// its retries.
    async fn project_postgres_state(
        &self,
        event: &OrderEventHeader,
    ) -> anyhow::Result<&'static str> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT status, version, user_id, reservation_id FROM orders WHERE order_id = $1",
                &[&event.order_id],
            )
            .await?
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "order {} of an event skipping a version is not in PostgreSQL",
                    event.order_id
                )
            })?;
        let state = OrderEventHeader {
            order_id: event.order_id.clone(),
            reservation_id: row.get(3),
            status: row.get(0),
            aggregate_version: row.get(1),
            user_id: row.get(2),
        };
        self.redis
            .projections()
            .project_many(
                &[&state],
                PROJECTION_TTL_SECS,
                Utc::now().timestamp_millis(),
                false,
            )
            .await?;
        Ok("from_postgres")
    }
}

#[async_trait::async_trait]
impl BatchHandler for ProjectionHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        if let Some(d) = &self.deferral {
            d.hold(super::deferral::MAX_HOLD).await;
        }
        match self.process(&batch).await {
            // An event waits for its order's earlier one: the broker holds the batch.
            Ok(labels) if labels.contains(&"held") => ConsumeDecision::Retry,
            result => poison::ack_or_retry(result, "projection", batch.len()),
        }
    }
}
