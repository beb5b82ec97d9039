//! The outbox relay's side of PostgreSQL
//! (docs/architecture/recovery.md#outbox-relay): claim due PENDING rows with a lease
//! (one short statement with `FOR UPDATE SKIP LOCKED`, so relays never block each other or
//! the order transactions), then record what the send came to. A relay that dies between
//! the send and the mark leaves the lease to expire: the row is sent again with the same
//! event id and the consumers' inboxes absorb the duplicate.

use crate::domain::status::OutboxStatus;
use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

/// Channel the writers `NOTIFY` after adding outbox rows; the relay `LISTEN`s on it.
pub const OUTBOX_CHANNEL: &str = "seckill_outbox";

/// Wakes the relays: the outbox has new rows.
pub async fn notify(client: &impl GenericClient) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!("NOTIFY {OUTBOX_CHANNEL}"))
        .await
}

/// Subscribes this connection to [`notify`]'s wake-ups.
pub async fn listen(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!("LISTEN {OUTBOX_CHANNEL}"))
        .await
}

/// One outbox row, claimed for sending.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    /// The row's distribution key: with `event_id`, its primary key.
    pub activity_id: i64,
    pub event_id: String,
    pub topic: String,
    pub tag: String,
    pub message_key: String,
    pub aggregate_id: Option<String>,
    pub aggregate_version: Option<i32>,
    pub payload: serde_json::Value,
    pub deliver_at: Option<DateTime<Utc>>,
    /// Attempts including this one.
    pub attempts: i32,
}

/// Claims up to `limit` due rows and pushes their next attempt `lease_secs` ahead.
pub async fn claim(
    client: &impl GenericClient,
    limit: i64,
    lease_secs: f64,
) -> Result<Vec<OutboxRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "WITH due AS (
                SELECT activity_id, event_id FROM event_outbox_by_day
                WHERE status = 'PENDING' AND next_attempt_at <= now()
                ORDER BY next_attempt_at
                LIMIT $1
                FOR UPDATE SKIP LOCKED)
             UPDATE event_outbox_by_day o
                SET next_attempt_at = now() + make_interval(secs => $2), attempts = o.attempts + 1
             FROM due WHERE o.activity_id = due.activity_id AND o.event_id = due.event_id
             RETURNING o.event_id, o.topic, o.tag, o.message_key, o.aggregate_id,
                       o.aggregate_version, o.payload, o.deliver_at, o.attempts, o.created_at,
                       o.activity_id",
            &[&limit, &lease_secs],
        )
        .await?;
    let mut out: Vec<(DateTime<Utc>, OutboxRow)> = rows
        .iter()
        .map(|r| {
            (
                r.get(9),
                OutboxRow {
                    activity_id: r.get(10),
                    event_id: r.get(0),
                    topic: r.get(1),
                    tag: r.get(2),
                    message_key: r.get(3),
                    aggregate_id: r.get(4),
                    aggregate_version: r.get(5),
                    payload: r.get(6),
                    deliver_at: r.get(7),
                    attempts: r.get(8),
                },
            )
        })
        .collect();
    // Oldest first, and an aggregate's versions in order.
    out.sort_by(|a, b| {
        (a.0, a.1.aggregate_version.unwrap_or(0)).cmp(&(b.0, b.1.aggregate_version.unwrap_or(0)))
    });
    Ok(out.into_iter().map(|(_, r)| r).collect())
}

/// A row the broker confirmed: its key and the broker's id for it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub activity_id: i64,
    pub event_id: String,
    pub broker_msg_id: String,
}

/// Marks rows SENT with the broker's id.
pub async fn mark_sent(
    client: &impl GenericClient,
    sent: &[Sent],
) -> Result<u64, tokio_postgres::Error> {
    mark_sent_from(client, sent, OutboxStatus::Pending.as_str()).await
}

/// Marks rows still in status `from` SENT with the broker's id, in one statement.
///
/// Every statement here finds its rows by the whole primary key (`activity_id`, `event_id`):
/// PostgreSQL then knows each lookup is one row. By `event_id` alone, on a table whose
/// statistics lag behind a sale's burst of rows, it guessed thousands per id and intersected
/// a scan of the whole PENDING index with each one: the relay fell to ~170 events/s on an
/// outbox of 350,000 pending rows.
pub(super) async fn mark_sent_from(
    client: &impl GenericClient,
    sent: &[Sent],
    from: &str,
) -> Result<u64, tokio_postgres::Error> {
    if sent.is_empty() {
        return Ok(0);
    }
    let activities: Vec<i64> = sent.iter().map(|s| s.activity_id).collect();
    let ids: Vec<&str> = sent.iter().map(|s| s.event_id.as_str()).collect();
    let broker: Vec<&str> = sent.iter().map(|s| s.broker_msg_id.as_str()).collect();
    client
        .execute(
            "UPDATE event_outbox_by_day o SET status = 'SENT', sent_at = now(), broker_msg_id = t.b, last_error = NULL
             FROM unnest($1::int8[], $2::text[], $3::text[]) AS t(a, e, b)
             WHERE o.activity_id = t.a AND o.event_id = t.e AND o.status = $4",
            &[&activities, &ids, &broker, &from],
        )
        .await
}

/// Puts back to PENDING, for the relay to send again under the same event id, up to `batch`
/// RELEASE_RESERVATION rows sent before `cutoff` whose compensation task is still PENDING:
/// the broker confirmed them but the compensation consumers never took them (its broker may
/// be dead: docs/architecture/messages.md#a-dead-brokers-messages). Returns their event ids.
pub async fn requeue_unconsumed_releases(
    client: &impl GenericClient,
    cutoff: chrono::DateTime<chrono::Utc>,
    batch: i64,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "WITH stranded AS (
                 SELECT o.activity_id, o.event_id
                 FROM compensation_tasks t
                 JOIN event_outbox_by_day o ON o.activity_id = t.activity_id
                                    AND o.event_id = t.reservation_id || '.RELEASE_RESERVATION'
                 WHERE t.status = 'PENDING' AND t.created_at < $1
                   AND o.status = 'SENT' AND o.sent_at < $1
                 ORDER BY t.created_at
                 LIMIT $2
                 FOR UPDATE OF o SKIP LOCKED)
             UPDATE event_outbox_by_day o
             SET status = 'PENDING', next_attempt_at = now(),
                 last_error = 'confirmed but not consumed in time: sent again'
             FROM stranded s
             WHERE o.activity_id = s.activity_id AND o.event_id = s.event_id
             RETURNING o.event_id",
            &[&cutoff, &batch],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A send that did not go through: the row's next attempt, or its end.
#[derive(Debug, Clone)]
pub struct Failure {
    pub activity_id: i64,
    pub event_id: String,
    pub error: String,
    /// When to try again, from now.
    pub backoff_ms: i64,
    /// The last attempt failed: the row becomes DEAD.
    pub dead: bool,
    /// The broker refused the message (rather than not answering): a DEAD row of this kind
    /// waits for an operator instead of coming back by itself.
    pub refused: bool,
}

/// Schedules each failed row's next attempt after its backoff, or marks it DEAD; one
/// statement for the whole pass.
pub async fn mark_failed(
    client: &impl GenericClient,
    failed: &[Failure],
) -> Result<u64, tokio_postgres::Error> {
    if failed.is_empty() {
        return Ok(0);
    }
    let activities: Vec<i64> = failed.iter().map(|f| f.activity_id).collect();
    let ids: Vec<&str> = failed.iter().map(|f| f.event_id.as_str()).collect();
    let errors: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
    let backoff: Vec<f64> = failed.iter().map(|f| f.backoff_ms as f64).collect();
    let dead: Vec<bool> = failed.iter().map(|f| f.dead).collect();
    let refused: Vec<bool> = failed.iter().map(|f| f.refused).collect();
    client
        .execute(
            "UPDATE event_outbox_by_day o
                SET last_error = t.err,
                    status = CASE WHEN t.dead THEN 'DEAD' ELSE o.status END,
                    dead_reason = CASE WHEN NOT t.dead THEN NULL
                                       WHEN t.refused THEN 'REFUSED' ELSE 'BROKER' END,
                    next_attempt_at = now() + make_interval(secs => t.ms / 1000.0)
             FROM unnest($1::int8[], $2::text[], $3::text[], $4::float8[], $5::bool[], $6::bool[])
                  AS t(a, e, err, ms, dead, refused)
             WHERE o.activity_id = t.a AND o.event_id = t.e AND o.status = 'PENDING'",
            &[&activities, &ids, &errors, &backoff, &dead, &refused],
        )
        .await
}

/// How many times the relay brings one row back by itself before it waits for an operator.
pub const MAX_AUTO_REQUEUES: i32 = 3;

/// An operator's requeue: DEAD rows back to PENDING with a fresh attempt count, these
/// `event_ids` or (`None`) every DEAD row. Returns the ids requeued.
pub async fn requeue_dead(
    client: &impl GenericClient,
    event_ids: Option<&[String]>,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "UPDATE event_outbox_by_day SET status = 'PENDING', attempts = 0, next_attempt_at = now(),
                    dead_reason = NULL
             WHERE status = 'DEAD' AND ($1::text[] IS NULL OR event_id = ANY($1))
             RETURNING event_id",
            &[&event_ids],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The relay's own requeue once the broker answers again: up to `limit` rows that went DEAD
/// because the broker did not answer (not because it refused them), oldest first, each at most
/// [`MAX_AUTO_REQUEUES`] times. Returns how many came back.
pub async fn requeue_broker_dead(
    client: &impl GenericClient,
    limit: i64,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "UPDATE event_outbox_by_day SET status = 'PENDING', attempts = 0, next_attempt_at = now(),
                    dead_reason = NULL, auto_requeues = auto_requeues + 1
             WHERE (activity_id, event_id) IN (
                 SELECT activity_id, event_id FROM event_outbox_by_day
                 WHERE status = 'DEAD' AND dead_reason = 'BROKER' AND auto_requeues < $2
                 ORDER BY created_at LIMIT $1
                 FOR UPDATE SKIP LOCKED)",
            &[&limit, &MAX_AUTO_REQUEUES],
        )
        .await
}

/// The outbox's backlog (`Relay::observe`).
pub struct Backlog {
    /// Rows due to be sent now (their first send or retry time has come).
    pub due: i64,
    /// How long the oldest due row has been due, in seconds: since its creation, or for a
    /// timer held back, since `timer_lead` before its deliver time.
    pub oldest_due_age_secs: f64,
    /// Rows waiting for a later time: timers held until shortly before they are due, and rows
    /// backing off after a failed send.
    pub not_yet_due: i64,
    pub dead: i64,
    /// Rows of transaction messages whose producer has not marked them sent yet
    /// (docs/architecture/messages.md#delivering-events): the relay never sends these.
    pub in_transaction: i64,
}

/// The settings of [`on_partial_indexes`], for a caller that runs its own transaction.
pub const ON_PARTIAL_INDEXES: &str = "SET LOCAL enable_seqscan = off; SET LOCAL jit = off; \
     SET LOCAL max_parallel_workers_per_gather = 0";

/// Makes the rest of the transaction `tx` read the outbox's partial indexes whatever its
/// statistics say: no sequential scan, no parallel workers, no JIT. The backlog's counts run
/// every second; on a table whose statistics were taken while most rows were PENDING (an
/// ANALYZE during a burst) the planner read the whole table, SENT rows included, with two
/// parallel workers: 178 ms of three processes every second beside the relay, where the
/// partial index answers in a few (docs/architecture/recovery.md#outbox-relay, "Rows by their whole
/// key").
pub async fn on_partial_indexes(
    tx: &tokio_postgres::Transaction<'_>,
) -> Result<(), tokio_postgres::Error> {
    tx.batch_execute(ON_PARTIAL_INDEXES).await
}

/// The outbox's backlog, one subquery per partial index; run it after [`on_partial_indexes`].
pub async fn backlog(
    client: &impl GenericClient,
    timer_lead_secs: f64,
) -> Result<Backlog, tokio_postgres::Error> {
    let row = client
        .query_one(
            // One subquery per status, so each reads its own partial index
            // (event_outbox_pending, event_outbox_dead): `status IN (...)` over both made the
            // planner scan the whole table, SENT rows included, every second (seen in make soak).
            "SELECT (SELECT count(*) FROM event_outbox_by_day
                     WHERE status = 'PENDING' AND next_attempt_at <= now()),
                    coalesce((SELECT extract(epoch FROM now() - min(greatest(
                                  created_at, deliver_at - make_interval(secs => $1))))
                              FROM event_outbox_by_day
                              WHERE status = 'PENDING' AND next_attempt_at <= now()), 0)::float8,
                    (SELECT count(*) FROM event_outbox_by_day
                     WHERE status = 'PENDING' AND next_attempt_at > now()),
                    (SELECT count(*) FROM event_outbox_by_day WHERE status = 'DEAD'),
                    (SELECT count(*) FROM event_outbox_by_day WHERE status = 'TRANSACTION')",
            &[&timer_lead_secs],
        )
        .await?;
    Ok(Backlog {
        due: row.get(0),
        oldest_due_age_secs: row.get::<_, f64>(1).max(0.0),
        not_yet_due: row.get(2),
        dead: row.get(3),
        in_transaction: row.get(4),
    })
}

/// Exponential backoff with ±20 % jitter: `base × 2^(attempt-1)`, capped.
pub fn backoff_ms(attempt: i32, base_ms: u64, cap_ms: u64) -> u64 {
    let exp = base_ms.saturating_mul(1u64 << (attempt.clamp(1, 20) - 1) as u32);
    let capped = exp.min(cap_ms).max(1);
    let jitter = rand::random_range(0.8..1.2);
    ((capped as f64) * jitter) as u64
}

/// The broker message for an outbox row: its event id is the `message_id` every consumer
/// deduplicates on; order events carry their order id as the ordering key.
pub fn outbox_message(row: &OutboxRow) -> crate::mq::OutMessage {
    let mut properties = vec![
        ("message_id".to_string(), row.event_id.clone()),
        (
            "event_type".to_string(),
            row.payload["event_type"].as_str().unwrap_or("").to_string(),
        ),
    ];
    if let Some(v) = row.aggregate_version {
        properties.push(("aggregate_version".to_string(), v.to_string()));
    }
    if let Some(tp) = row.payload["traceparent"]
        .as_str()
        .filter(|t| !t.is_empty())
    {
        properties.push(("traceparent".to_string(), tp.to_string()));
    }
    let now_ms = chrono::Utc::now().timestamp_millis();
    crate::mq::OutMessage {
        topic: row.topic.clone(),
        tag: row.tag.clone(),
        keys: vec![row.message_key.clone()],
        properties,
        body: serde_json::to_vec(&row.payload).unwrap_or_default(),
        // Past deliver times are sent as normal messages: the cancel is due now.
        deliver_time_ms: row
            .deliver_at
            .map(|d| d.timestamp_millis())
            .filter(|&ms| ms > now_ms + 1000),
        // Events of one order go to one queue, in version order
        // (docs/architecture/messages.md#event-ordering).
        sharding_key: if row.topic.ends_with("_SECKILL_ORDER_EVENT_V1") {
            row.aggregate_id.clone()
        } else {
            None
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        for _ in 0..100 {
            let b1 = backoff_ms(1, 100, 30_000);
            assert!((80..=120).contains(&b1), "{b1}");
            let b4 = backoff_ms(4, 100, 30_000);
            assert!((640..=960).contains(&b4), "{b4}");
            let b30 = backoff_ms(30, 100, 30_000);
            assert!((24_000..=36_000).contains(&b30), "{b30}");
        }
    }
}
