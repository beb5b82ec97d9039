//! Compensation consumer (runs inside `seckill consume`): RELEASE_RESERVATION events give a
//! reservation's unit back to Redis exactly once — the Lua script only releases a RESERVED
//! reservation — and then mark the compensation task DONE in PostgreSQL. A redelivery after a
//! crash between the two finds the reservation RELEASED and only completes the task.

use chrono::Utc;
use tracing::{error, info, warn};

use crate::domain::events::ReleaseReservation;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::order_state::compensation_done;
use crate::redis::RedisStore;

pub struct CompensationHandler {
    pub redis: RedisStore,
    pub pool: deadpool_postgres::Pool,
    pub group: String,
}

impl CompensationHandler {
    /// Processes one message; `Err` means retry later.
    pub async fn process(&self, d: &Delivery) -> anyhow::Result<&'static str> {
        let client = self.pool.get().await?;
        let release: ReleaseReservation = match serde_json::from_slice(&d.body) {
            Ok(r) => r,
            Err(e) => {
                crate::pg::quarantine(&**client, &self.group, d, "INVALID_EVENT", &e.to_string())
                    .await?;
                metrics::counter!("mq_quarantine_total", "reason" => "INVALID_EVENT").increment(1);
                warn!(broker_msg_id = %d.broker_msg_id, error = %e, "poison compensation message quarantined");
                return Ok("quarantined");
            }
        };
        let result = self
            .redis
            .release(
                release.activity_id,
                release.sku_id,
                &release.reservation_id,
                &release.reason,
                Utc::now().timestamp_millis(),
            )
            .await?;
        let label = match result.as_str() {
            "RELEASED" => "released",
            "ALREADY_RELEASED" => "already_released",
            _ => "missing",
        };
        if label == "missing" {
            // The reservation hash is gone (TTL or data loss): nothing to give back in Redis;
            // reconcile reports the stock drift.
            error!(reservation_id = %release.reservation_id, activity_id = release.activity_id,
                   "compensation found no reservation in Redis");
        }
        compensation_done(&**client, &release.reservation_id).await?;
        metrics::counter!("compensation_total", "result" => label).increment(1);
        info!(reservation_id = %release.reservation_id, reason = %release.reason, result = label,
              delivery_attempt = d.reconsume_times, "compensation applied");
        Ok(label)
    }
}

#[async_trait::async_trait]
impl BatchHandler for CompensationHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        for d in &batch {
            if let Err(e) = self.process(d).await {
                warn!(error = %e, broker_msg_id = %d.broker_msg_id, "compensation failed; will be redelivered");
                return ConsumeDecision::Retry;
            }
        }
        ConsumeDecision::Ack
    }
}
