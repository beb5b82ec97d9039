//! The order-status projection the buyer's reads are answered from first.

use std::collections::HashMap;

use deadpool_redis::redis::{self, AsyncCommands};

use super::{pool, Projections, StoreError};

impl Projections<'_> {
    /// Applies order events to the projection, each only if it is newer than what is there,
    /// in one round trip (in order). Returns `APPLIED` or `STALE` per event; with `in_order`,
    /// `GAP` for one that skips a version (applied by nobody: the caller holds it).
    pub async fn project_many(
        &self,
        events: &[&crate::domain::events::OrderEventHeader],
        ttl_secs: u64,
        now_ms: i64,
        in_order: bool,
    ) -> Result<Vec<String>, StoreError> {
        let script = &self.scripts.project;
        let calls: Vec<(u16, redis::ScriptInvocation<'_>)> = events
            .iter()
            .map(|event| {
                let key = self.keys.projection(&event.reservation_id);
                let slot = if self.cluster { pool::slot(&key) } else { 0 };
                let call = script
                    .call()
                    .key("projection", key)
                    .arg("version", event.aggregate_version)
                    .arg("status", &event.status)
                    .arg("order_id", &event.order_id)
                    .arg("reservation_id", &event.reservation_id)
                    .arg("ttl_secs", ttl_secs)
                    .arg("now_ms", now_ms)
                    .arg("user_id", event.user_id)
                    .arg("in_order", if in_order { "1" } else { "0" });
                (slot, call.done())
            })
            .collect();
        self.pipelined(script, &calls).await
    }

    /// The projected order status of a reservation (empty when none yet).
    pub async fn projection(
        &self,
        reservation_id: &str,
    ) -> Result<HashMap<String, String>, StoreError> {
        let mut conn = self.pool.get().await?;
        Ok(conn.hgetall(self.keys.projection(reservation_id)).await?)
    }
}
