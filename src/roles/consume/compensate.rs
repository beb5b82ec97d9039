//! Compensation consumer (runs inside `seckill consume`): RELEASE_RESERVATION events give a
//! reservation's unit back to Redis exactly once — the Lua script only releases a RESERVED
//! reservation — and then mark the compensation task DONE in PostgreSQL. A redelivery after a
//! crash between the two finds the reservation RELEASED and only completes the task.
//!
//! A delivered batch costs two round trips whatever its size: the releases pipelined to Redis,
//! then one UPDATE of the batch's tasks.

use chrono::Utc;
use tracing::{debug, warn};

use crate::domain::events::ReleaseReservation;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::order_state::compensations_done;

use crate::redis::{RedisStore, Release, Released};
use crate::services::poison;

pub struct CompensationHandler {
    pub redis: RedisStore,
    pub pool: deadpool_postgres::Pool,
    pub group: String,
}

impl CompensationHandler {
    /// Processes a batch: `released`, `already_released`, `missing` or `quarantined` per
    /// message, in order; `Err` means retry the batch later (every step is idempotent).
    pub async fn process(&self, batch: &[Delivery]) -> anyhow::Result<Vec<&'static str>> {
        let mut labels: Vec<&'static str> = vec!["quarantined"; batch.len()];
        let releases: Vec<(usize, ReleaseReservation)> =
            poison::decode_each(&self.pool, &self.group, batch).await?;
        let client = self.pool.get().await?;
        let calls: Vec<Release<'_>> = releases
            .iter()
            .map(|(_, r)| Release {
                activity_id: r.activity_id,
                sku_id: r.sku_id,
                reservation_id: &r.reservation_id,
                reason: &r.reason,
            })
            .collect();
        let results = self
            .redis
            .sends()
            .release_many(&calls, Utc::now().timestamp_millis())
            .await?;
        let done: Vec<&str> = releases
            .iter()
            .map(|(_, r)| r.reservation_id.as_str())
            .collect();
        compensations_done(&**client, &done).await?;
        drop(client);
        let mut forgotten: Vec<i64> = Vec::new();
        for ((i, release), result) in releases.iter().zip(&results) {
            let label = match result {
                Released::Now => "released",
                Released::Already => "already_released",
                Released::Missing => "missing",
            };
            if label == "missing" {
                // The reservation hash is gone: Redis forgot it (its TTL outlives any sale).
                // Nothing is given back here; the activity is fenced and its rebuild from
                // PostgreSQL counts this unit (docs/architecture/redis.md#when-redis-forgets).
                warn!(reservation_id = %release.reservation_id, activity_id = release.activity_id,
                      "compensation found no reservation in Redis: the activity's Redis state is rebuilt");
                if !forgotten.contains(&release.activity_id) {
                    forgotten.push(release.activity_id);
                }
            }
            metrics::counter!("compensation_total", "result" => label).increment(1);
            debug!(reservation_id = %release.reservation_id, reason = %release.reason,
                  result = label, delivery_attempt = batch[*i].reconsume_times,
                  "compensation applied");
            labels[*i] = label;
        }
        for activity_id in forgotten {
            let detail = "a compensation found no reservation in Redis";
            let by = crate::services::resync::actor("consume");
            crate::services::resync::raise(
                &self.pool,
                &self.redis,
                activity_id,
                "compensation_missing",
                detail,
                &by,
            )
            .await?;
        }
        Ok(labels)
    }
}

#[async_trait::async_trait]
impl BatchHandler for CompensationHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        poison::ack_or_retry(self.process(&batch).await, "compensation", batch.len())
    }
}
