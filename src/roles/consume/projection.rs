//! Order-event projection (runs inside `seckill consume`, group
//! `CG_SECKILL_ORDER_QUERY_PROJECTION_V1`): keeps the buyer-facing status of each reservation
//! in Redis from ORDER_CREATED / ORDER_PAID / ORDER_CANCELED. Each event carries the order's
//! `aggregate_version` and the Lua script applies it only when newer, so a duplicate or a
//! stale replay is a no-op and out-of-order arrival converges on the latest state
//! (docs/ARCHITECTURE.md#event-ordering).

use chrono::Utc;
use tracing::{debug, warn};

use crate::domain::events::OrderEventHeader;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::redis::RedisStore;

/// How long a projection outlives its last update (buyers poll for minutes, not weeks).
pub const PROJECTION_TTL_SECS: u64 = 7 * 24 * 3600;

pub struct ProjectionHandler {
    pub redis: RedisStore,
    pub pool: deadpool_postgres::Pool,
    pub group: String,
}

impl ProjectionHandler {
    /// Applies one event; returns `applied`, `stale` or `quarantined`; `Err` = retry.
    pub async fn process(&self, d: &Delivery) -> anyhow::Result<&'static str> {
        let event: OrderEventHeader = match serde_json::from_slice(&d.body) {
            Ok(e) => e,
            Err(e) => {
                let client = self.pool.get().await?;
                crate::pg::quarantine(&**client, &self.group, d, "INVALID_EVENT", &e.to_string())
                    .await?;
                metrics::counter!("mq_quarantine_total", "reason" => "INVALID_EVENT").increment(1);
                return Ok("quarantined");
            }
        };
        let r = self
            .redis
            .project(&event, PROJECTION_TTL_SECS, Utc::now().timestamp_millis())
            .await?;
        let label = if r == "APPLIED" { "applied" } else { "stale" };
        metrics::counter!("projection_apply_total", "result" => label).increment(1);
        debug!(order_id = %event.order_id, version = event.aggregate_version, status = %event.status,
               result = label, "order event projected");
        Ok(label)
    }
}

#[async_trait::async_trait]
impl BatchHandler for ProjectionHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        for d in &batch {
            if let Err(e) = self.process(d).await {
                warn!(error = %e, broker_msg_id = %d.broker_msg_id, "projection failed; will be redelivered");
                return ConsumeDecision::Retry;
            }
        }
        ConsumeDecision::Ack
    }
}
