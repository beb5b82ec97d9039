//! Order-event projection (runs inside `seckill consume`, group
//! `CG_SECKILL_ORDER_QUERY_PROJECTION_V1`): keeps the buyer-facing status of each reservation
//! in Redis from ORDER_CREATED / ORDER_PAID / ORDER_CANCELED. Each event carries the order's
//! `aggregate_version` and the Lua script applies it only when newer, so a duplicate or a
//! stale replay is a no-op and out-of-order arrival converges on the latest state
//! (docs/architecture/messages.md#event-ordering). A delivered batch is one pipelined round trip.

use chrono::Utc;
use tracing::debug;

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

impl ProjectionHandler {
    /// Applies a batch of events: `applied`, `stale` or `quarantined` per message, in order;
    /// `Err` = retry the batch (re-applying is a no-op).
    pub async fn process(&self, batch: &[Delivery]) -> anyhow::Result<Vec<&'static str>> {
        let mut labels: Vec<&'static str> = vec!["quarantined"; batch.len()];
        let events: Vec<(usize, OrderEventHeader)> =
            poison::decode_each(&self.pool, &self.group, batch).await?;
        let headers: Vec<&OrderEventHeader> = events.iter().map(|(_, e)| e).collect();
        let results = self
            .redis
            .projections()
            .project_many(&headers, PROJECTION_TTL_SECS, Utc::now().timestamp_millis())
            .await?;
        for ((i, event), r) in events.iter().zip(&results) {
            let label = if r == "APPLIED" { "applied" } else { "stale" };
            metrics::counter!("projection_apply_total", "result" => label).increment(1);
            debug!(order_id = %event.order_id, version = event.aggregate_version,
                   status = %event.status, result = label, "order event projected");
            labels[*i] = label;
        }
        Ok(labels)
    }
}

#[async_trait::async_trait]
impl BatchHandler for ProjectionHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        if let Some(d) = &self.deferral {
            d.hold(super::deferral::MAX_HOLD).await;
        }
        poison::ack_or_retry(self.process(&batch).await, "projection", batch.len())
    }
}
