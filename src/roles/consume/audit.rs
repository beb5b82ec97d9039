//! The audit stream (runs inside `seckill consume`, group `CG_SECKILL_AUDIT_V1`): every event of
//! the order-event topic appended to `audit_events` as it was published, one row per event
//! however often it is delivered (docs/architecture/messages.md#the-audit-stream). The table is
//! partitioned by the day the order's id was minted; a day's partition is made when its first
//! event arrives. Nothing here reads or writes the order tables.

use std::collections::HashSet;
use std::sync::Mutex;

use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use serde_json::Value;

use crate::pg::audit_stream::{insert, AuditRow};
use tracing::debug;

use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::services::poison;

pub struct AuditHandler {
    pub pool: deadpool_postgres::Pool,
    pub group: String,
    /// The days whose partition this process made or found.
    pub(crate) days: Mutex<HashSet<NaiveDate>>,
}

/// The row of a delivered event whose body is JSON. Its id is the `message_id` property (the
/// event id every copy carries), else the body's `event_id`; its order the body's
/// `order_id`, else the message keys; `order_at` the time in the order id's ULID, else when
/// the broker stored this copy.
fn row_of(d: &Delivery, payload: Value) -> AuditRow {
    let stored_at = Utc
        .timestamp_millis_opt(d.store_timestamp_ms)
        .single()
        .unwrap_or_else(Utc::now);
    let text = |k: &str| payload.get(k).and_then(Value::as_str).map(str::to_string);
    let order_id = text("order_id").unwrap_or_else(|| d.keys.clone());
    let message_id = d
        .properties
        .get("message_id")
        .map(str::to_string)
        .or_else(|| text("event_id"))
        .unwrap_or_else(|| d.broker_msg_id.clone());
    AuditRow {
        order_at: minted_at(&order_id).unwrap_or(stored_at),
        event_type: if d.tags.is_empty() {
            text("event_type").unwrap_or_default()
        } else {
            d.tags.clone()
        },
        activity_id: payload.get("activity_id").and_then(Value::as_i64),
        aggregate_version: payload
            .get("aggregate_version")
            .and_then(Value::as_i64)
            .and_then(|v| i32::try_from(v).ok()),
        message_id,
        order_id,
        payload,
        topic: d.topic.clone(),
        broker_msg_id: d.broker_msg_id.clone(),
        stored_at,
    }
}

/// The time an order id (`ord_<ulid>`) was minted.
fn minted_at(order_id: &str) -> Option<DateTime<Utc>> {
    let ulid = ulid::Ulid::from_string(order_id.strip_prefix("ord_")?).ok()?;
    Utc.timestamp_millis_opt(ulid.timestamp_ms() as i64)
        .single()
}

impl AuditHandler {
    pub fn new(pool: deadpool_postgres::Pool, group: String) -> Self {
        Self {
            pool,
            group,
            days: Mutex::new(HashSet::new()),
        }
    }

    /// Records a batch: how many rows it added (a redelivered event adds none). `Err` = retry
    /// the batch (recording again is a no-op). A body that is not JSON is quarantined.
    pub async fn process(&self, batch: &[Delivery]) -> anyhow::Result<u64> {
        let events: Vec<(usize, Value)> =
            poison::decode_each(&self.pool, &self.group, batch).await?;
        let rows: Vec<AuditRow> = events
            .into_iter()
            .map(|(i, payload)| row_of(&batch[i], payload))
            .collect();
        if rows.is_empty() {
            return Ok(0);
        }
        let client = self.pool.get().await?;
        self.partitions_for(&client, &rows).await?;
        let added = match insert(&client, &rows).await {
            Ok(n) => n,
            Err(e) => {
                // A day's partition retention shed after this process made it (a late event of
                // an old order) is made again on the retry.
                self.days.lock().unwrap_or_else(|e| e.into_inner()).clear();
                return Err(e);
            }
        };
        let repeated = rows.len() as u64 - added;
        metrics::counter!("audit_events_recorded_total", "result" => "added").increment(added);
        metrics::counter!("audit_events_recorded_total", "result" => "repeat").increment(repeated);
        debug!(added, repeated, "order events recorded for audit");
        Ok(added)
    }

    /// Makes the partition of each day the batch's rows fall on, once per process.
    async fn partitions_for(
        &self,
        client: &tokio_postgres::Client,
        rows: &[AuditRow],
    ) -> anyhow::Result<()> {
        let wanted: HashSet<NaiveDate> = rows.iter().map(|r| r.order_at.date_naive()).collect();
        let missing: Vec<NaiveDate> = {
            let known = self.days.lock().unwrap_or_else(|e| e.into_inner());
            wanted.difference(&known).copied().collect()
        };
        for day in missing {
            crate::pg::partitions::ensure_day(client, "audit_events", day).await?;
            self.days
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(day);
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl BatchHandler for AuditHandler {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        poison::ack_or_retry(self.process(&batch).await, "audit", batch.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_ids_ulid_gives_the_day_of_its_events() {
        let id = format!("ord_{}", ulid::Ulid::from_parts(1_765_000_000_000, 7));
        assert_eq!(
            minted_at(&id).unwrap().timestamp_millis(),
            1_765_000_000_000
        );
        assert_eq!(minted_at("ord_not-a-ulid"), None);
        assert_eq!(minted_at("rsv_01M9889EJY8HRCJKX9CP9XKE99"), None);
    }
}
