//! Quarantined messages as operators see them (`seckill dlq list --quarantined`): what a
//! consumer could never read, kept with its raw body; `pg::replay` sends them back.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::GenericClient;

/// One quarantined message.
#[derive(Debug, Clone, Serialize)]
pub struct Quarantined {
    pub quarantine_id: i64,
    pub consumer_group: String,
    pub topic: String,
    pub message_id: Option<String>,
    /// Why it was quarantined: `INVALID_JSON`, `UNSUPPORTED_SCHEMA`, `INVALID_EVENT`.
    pub reason: String,
    pub error: String,
    /// `QUARANTINED`, or `REPLAYED` once an operator sent it back.
    pub status: String,
    pub received_at: DateTime<Utc>,
    /// The raw body, as text where it is UTF-8 (lossy otherwise).
    pub payload: String,
}

fn quarantined(r: &tokio_postgres::Row) -> Quarantined {
    Quarantined {
        quarantine_id: r.get(0),
        consumer_group: r.get(1),
        topic: r.get(2),
        message_id: r.get(3),
        reason: r.get(4),
        error: r.get(5),
        status: r.get(6),
        received_at: r.get(7),
        payload: String::from_utf8_lossy(&r.get::<_, Vec<u8>>(8)).to_string(),
    }
}

const COLUMNS: &str = "quarantine_id, consumer_group, topic, message_id, reason, error, status,
    received_at, raw_body";

/// Quarantined messages by status (and group), oldest first, at most `limit`.
pub async fn list(
    client: &impl GenericClient,
    status: Option<&str>,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<Quarantined>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM quarantined_messages
         WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR consumer_group = $2)
         ORDER BY received_at, quarantine_id LIMIT $3"
    );
    Ok(client
        .query(&sql, &[&status, &group, &limit])
        .await?
        .iter()
        .map(quarantined)
        .collect())
}

pub async fn show(
    client: &impl GenericClient,
    quarantine_id: i64,
) -> Result<Option<Quarantined>, tokio_postgres::Error> {
    let sql = format!("SELECT {COLUMNS} FROM quarantined_messages WHERE quarantine_id = $1");
    Ok(client
        .query_opt(&sql, &[&quarantine_id])
        .await?
        .as_ref()
        .map(quarantined))
}
