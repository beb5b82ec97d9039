//! `audit_events`: the audit stream's append-only record of the order events
//! (docs/architecture/messages.md#the-audit-stream), written by the audit group alone.

use chrono::{DateTime, Utc};
use serde_json::Value;

/// One event as the audit table records it.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRow {
    pub order_at: DateTime<Utc>,
    pub message_id: String,
    pub event_type: String,
    pub order_id: String,
    pub activity_id: Option<i64>,
    pub aggregate_version: Option<i32>,
    pub payload: Value,
    pub topic: String,
    pub broker_msg_id: String,
    pub stored_at: DateTime<Utc>,
}

/// Appends the rows, a repeat of an event already there changing nothing; how many were new.
pub async fn insert(client: &tokio_postgres::Client, rows: &[AuditRow]) -> anyhow::Result<u64> {
    let col = |f: fn(&AuditRow) -> String| rows.iter().map(f).collect::<Vec<String>>();
    let order_at: Vec<DateTime<Utc>> = rows.iter().map(|r| r.order_at).collect();
    let stored_at: Vec<DateTime<Utc>> = rows.iter().map(|r| r.stored_at).collect();
    let activity: Vec<Option<i64>> = rows.iter().map(|r| r.activity_id).collect();
    let version: Vec<Option<i32>> = rows.iter().map(|r| r.aggregate_version).collect();
    let payload: Vec<Value> = rows.iter().map(|r| r.payload.clone()).collect();
    Ok(client
        .execute(
            "INSERT INTO audit_events (order_at, message_id, event_type, order_id, activity_id,
                                       aggregate_version, payload, topic, broker_msg_id, stored_at)
             SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[],
                                  $5::int8[], $6::int4[], $7::jsonb[], $8::text[], $9::text[],
                                  $10::timestamptz[])
             ON CONFLICT DO NOTHING",
            &[
                &order_at,
                &col(|r| r.message_id.clone()),
                &col(|r| r.event_type.clone()),
                &col(|r| r.order_id.clone()),
                &activity,
                &version,
                &payload,
                &col(|r| r.topic.clone()),
                &col(|r| r.broker_msg_id.clone()),
                &stored_at,
            ],
        )
        .await?)
}
