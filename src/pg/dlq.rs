//! Dead letters in PostgreSQL: intake of `%DLQ%<group>` copies, the failure that killed them,
//! the gauges, and the operator's list / show / discard (with an audit row each). Replays, of
//! dead letters and of quarantined messages alike, are `pg::replay`.

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::GenericClient;

use crate::mq::Delivery;

/// One message's failure: `(message_id, error class, error text)`.
pub type Failure<'a> = (&'a str, &'a str, String);

/// Remembers the latest failure of each message (called after their transaction rolled
/// back); one statement for the batch. A message listed twice keeps its last failure.
pub async fn record_failures(
    client: &impl GenericClient,
    group: &str,
    failures: &[Failure<'_>],
) -> Result<u64, tokio_postgres::Error> {
    // ON CONFLICT DO UPDATE may touch a row once per statement: one entry per message.
    let last: std::collections::HashMap<&str, (&str, &str)> = failures
        .iter()
        .map(|(id, class, error)| (*id, (*class, error.as_str())))
        .collect();
    if last.is_empty() {
        return Ok(0);
    }
    let ids: Vec<&str> = last.keys().copied().collect();
    let classes: Vec<&str> = ids.iter().map(|id| last[id].0).collect();
    let errors: Vec<&str> = ids.iter().map(|id| last[id].1).collect();
    client
        .execute(
            "INSERT INTO consumer_failures (consumer_group, message_id, error_class, last_error)
             SELECT $1, t.m, t.c, t.e FROM unnest($2::text[], $3::text[], $4::text[]) AS t(m, c, e)
             ON CONFLICT (consumer_group, message_id) DO UPDATE
               SET failures = consumer_failures.failures + 1, error_class = excluded.error_class,
                   last_error = excluded.last_error, updated_at = now()",
            &[&group, &ids, &classes, &errors],
        )
        .await
}

/// Records one dead letter of `group` (originally on `topic`); a repeat of the same DLQ copy
/// is a no-op. Returns true when the row is new.
pub async fn intake(
    client: &impl GenericClient,
    group: &str,
    topic: &str,
    d: &Delivery,
) -> Result<bool, tokio_postgres::Error> {
    let message_id = d.properties.get("message_id");
    let attempts: i32 = d
        .properties
        .get("RECONSUME_TIME")
        .and_then(|v| v.parse().ok())
        .unwrap_or(d.reconsume_times)
        .max(1);
    let props = serde_json::to_value(&d.properties).unwrap_or_default();
    let n = client
        .execute(
            "INSERT INTO dlq_messages
               (consumer_group, topic, message_id, reservation_id, order_id, broker_msg_id,
                dlq_queue_id, dlq_queue_offset, attempts, error_class, last_error, payload, properties)
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, f.error_class, f.last_error, $10, $11
             FROM (SELECT 1) one
             LEFT JOIN consumer_failures f ON f.consumer_group = $1 AND f.message_id = $3
             ON CONFLICT (consumer_group, dlq_queue_id, dlq_queue_offset) DO NOTHING",
            &[
                &group,
                &topic,
                &message_id,
                &d.properties.get("reservation_id"),
                &d.properties.get("order_id"),
                &d.properties.get("ORIGIN_MESSAGE_ID").unwrap_or(&d.broker_msg_id),
                &d.queue_id,
                &d.queue_offset,
                &attempts,
                &d.body,
                &props,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// `(open dead letters, age in seconds of the oldest open one)`.
pub async fn open_stats(client: &impl GenericClient) -> Result<(i64, f64), tokio_postgres::Error> {
    let r = client
        .query_one(
            "SELECT count(*), coalesce(extract(epoch FROM now() - min(first_seen)), 0)::float8
             FROM dlq_messages WHERE status = 'OPEN'",
            &[],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// Replays recorded in the audit table, by result label of `mq_dlq_replay_total`
/// (`confirmed`, `unknown`, `definite_failure`, `refused`; forced replays count under their
/// send outcome).
pub async fn replay_counts(
    client: &impl GenericClient,
) -> Result<Vec<(String, i64)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT outcome, count(*) FROM dlq_audit WHERE action = 'REPLAY' GROUP BY outcome",
            &[],
        )
        .await?;
    let mut counts: std::collections::BTreeMap<String, i64> = Default::default();
    for r in rows {
        let outcome: String = r.get(0);
        *counts.entry(replay_result(&outcome)).or_default() += r.get::<_, i64>(1);
    }
    Ok(counts.into_iter().collect())
}

/// `REFUSED_OLDER_THAN_RETENTION` → `refused`; `CONFIRMED_FORCED` → `confirmed`.
pub fn replay_result(outcome: &str) -> String {
    if outcome.starts_with("REFUSED") {
        return "refused".to_owned();
    }
    outcome
        .strip_suffix("_FORCED")
        .unwrap_or(outcome)
        .to_lowercase()
}

/// A dead letter as operators see it.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    pub dlq_id: i64,
    pub consumer_group: String,
    pub topic: String,
    pub message_id: Option<String>,
    pub reservation_id: Option<String>,
    pub order_id: Option<String>,
    pub attempts: i32,
    pub error_class: Option<String>,
    pub last_error: Option<String>,
    pub status: String,
    pub first_seen: DateTime<Utc>,
    /// The raw body, as text where it is UTF-8 (lossy otherwise).
    pub payload: String,
}

fn dead_letter(r: &tokio_postgres::Row) -> DeadLetter {
    DeadLetter {
        dlq_id: r.get(0),
        consumer_group: r.get(1),
        topic: r.get(2),
        message_id: r.get(3),
        reservation_id: r.get(4),
        order_id: r.get(5),
        attempts: r.get(6),
        error_class: r.get(7),
        last_error: r.get(8),
        status: r.get(9),
        first_seen: r.get(10),
        payload: String::from_utf8_lossy(&r.get::<_, Vec<u8>>(11)).to_string(),
    }
}

const COLUMNS: &str =
    "dlq_id, consumer_group, topic, message_id, reservation_id, order_id, attempts,
    error_class, last_error, status, first_seen, payload";

/// Dead letters by status (and group), oldest first, at most `limit`.
pub async fn list(
    client: &impl GenericClient,
    status: Option<&str>,
    group: Option<&str>,
    limit: i64,
) -> Result<Vec<DeadLetter>, tokio_postgres::Error> {
    let sql = format!(
        "SELECT {COLUMNS} FROM dlq_messages
         WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR consumer_group = $2)
         ORDER BY first_seen, dlq_id LIMIT $3"
    );
    Ok(client
        .query(&sql, &[&status, &group, &limit])
        .await?
        .iter()
        .map(dead_letter)
        .collect())
}

pub async fn show(
    client: &impl GenericClient,
    dlq_id: i64,
) -> Result<Option<DeadLetter>, tokio_postgres::Error> {
    let sql = format!("SELECT {COLUMNS} FROM dlq_messages WHERE dlq_id = $1");
    Ok(client
        .query_opt(&sql, &[&dlq_id])
        .await?
        .as_ref()
        .map(dead_letter))
}

/// What a discard did to the dead letter's message (`dlq_audit.effect`).
pub mod effect {
    /// An order-create message withdrawn: rejected with its compensation, so its reservation's
    /// unit goes back through the compensation path, once; a copy arriving later is a duplicate.
    pub const WITHDRAWN: &str = "WITHDRAWN";
    /// Another copy of the message was already decided (an order, or a rejection): nothing to
    /// give back here.
    pub const ALREADY_DECIDED: &str = "ALREADY_DECIDED";
    /// An order-create payload that does not decode: there is no reservation to name.
    pub const UNREADABLE: &str = "UNREADABLE";
    /// Another group's message: nothing is held by it.
    pub const NONE: &str = "NONE";
}

/// Who discards, why, and under which batch id (one per command).
#[derive(Debug, Clone, Copy)]
pub struct Decider<'a> {
    pub actor: &'a str,
    pub reason: &'a str,
    pub batch_id: &'a str,
}

/// Discards an OPEN dead letter, in one transaction with its audit row. An order-create dead
/// letter holds a reservation's unit: its message is withdrawn in the same transaction
/// (`order_tx::withdraw_in`), so the unit goes back exactly once, through the guarded
/// compensation path. Returns the effect ([`effect`]), or `None` if the dead letter was not
/// OPEN.
pub async fn discard(
    client: &mut deadpool_postgres::Client,
    order_create: &crate::pg::order_tx::TxNames,
    dlq_id: i64,
    who: &Decider<'_>,
) -> Result<Option<&'static str>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let Some(row) = tx
        .query_opt(
            "SELECT consumer_group, payload, properties, message_id, broker_msg_id
             FROM dlq_messages WHERE dlq_id = $1 AND status = 'OPEN' FOR UPDATE",
            &[&dlq_id],
        )
        .await?
    else {
        return Ok(None);
    };
    let group: String = row.get(0);
    let effect = if group == order_create.consumer_group {
        let payload: Vec<u8> = row.get(1);
        match crate::domain::OrderCreateRequested::decode(&payload) {
            Ok(event) => {
                let item = crate::pg::order_tx::Inbound {
                    event: Ok(event),
                    raw_body: payload,
                    properties: row.get(2),
                    property_message_id: row.get(3),
                    broker_msg_id: row.get::<_, Option<String>>(4).unwrap_or_default(),
                    delivery_attempt: 0,
                };
                let decisions =
                    crate::pg::order_tx::withdraw_in(&tx, order_create, &[item], Utc::now())
                        .await?;
                match decisions.first() {
                    Some(crate::domain::Decision::Rejected(_)) => effect::WITHDRAWN,
                    _ => effect::ALREADY_DECIDED,
                }
            }
            Err(_) => effect::UNREADABLE,
        }
    } else {
        effect::NONE
    };
    tx.execute(
        "UPDATE dlq_messages SET status = 'DISCARDED', updated_at = now() WHERE dlq_id = $1",
        &[&dlq_id],
    )
    .await?;
    tx.execute(
        "INSERT INTO dlq_audit (dlq_id, action, actor, reason, outcome, effect, replay_batch_id)
         VALUES ($1, 'DISCARD', $2, $3, 'DISCARDED', $4, $5)",
        &[&dlq_id, &who.actor, &who.reason, &effect, &who.batch_id],
    )
    .await?;
    tx.commit().await?;
    Ok(Some(effect))
}

#[cfg(test)]
mod tests {
    use super::replay_result;

    #[test]
    fn audit_outcomes_map_to_replay_results() {
        assert_eq!(replay_result("CONFIRMED"), "confirmed");
        assert_eq!(replay_result("CONFIRMED_FORCED"), "confirmed");
        assert_eq!(replay_result("UNKNOWN"), "unknown");
        assert_eq!(replay_result("DEFINITE_FAILURE_FORCED"), "definite_failure");
        assert_eq!(replay_result("REFUSED_OLDER_THAN_RETENTION"), "refused");
    }
}
