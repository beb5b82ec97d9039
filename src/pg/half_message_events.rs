//! The rows of events sent as RocketMQ transaction messages
//! (docs/architecture/messages.md#delivering-events): the local transaction writes the event's row
//! as TRANSACTION, a status the relay never claims; the producer marks it SENT once it ended the
//! half with a commit; the broker's check-back reads it; reconcile hands one left TRANSACTION past
//! the horizon to the relay.

use crate::domain::status::OutboxStatus;
use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

/// What PostgreSQL says about a transaction message's local transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The event's row is committed (in any status) with the half message's payload: the
    /// business change happened, with this very event.
    Committed,
    /// No row, the order's row lock taken, and the deadline past: the local transaction cannot
    /// commit any more (its last statement refuses past the deadline), so it never will. Or
    /// the row holds another payload: another writer's event under the same id (an earlier
    /// attempt's half asked about after a later attempt paid; the outbox's copy after a half
    /// that was not confirmed) is delivered its own way, and this half's transaction, which
    /// would have written this payload, did not commit.
    RolledBack,
    /// No row yet and the deadline not past: it may still commit.
    InFlight,
}

/// The check-back's answer for event `event_id` of order `order_id` with `payload`, whose local
/// transaction had to commit before `deadline`. The order's row lock (FOR SHARE) waits for a local
/// transaction that already changed the order to end, so a row it commits is seen; waiting is
/// bounded by `lock_timeout_ms` (an error then, which the caller answers UNKNOWN).
pub async fn verdict(
    client: &mut deadpool_postgres::Object,
    order_id: &str,
    event_id: &str,
    payload: &serde_json::Value,
    deadline: DateTime<Utc>,
    lock_timeout_ms: u64,
) -> Result<Verdict, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = {lock_timeout_ms}"))
        .await?;
    tx.query_opt(
        "SELECT 1 FROM orders WHERE order_id = $1 FOR SHARE",
        &[&order_id],
    )
    .await?;
    let row = tx
        .query_one(
            "SELECT (SELECT payload = $3 FROM event_outbox_by_day WHERE event_id = $1 LIMIT 1),
                    clock_timestamp() > $2",
            &[&event_id, &deadline, payload],
        )
        .await?;
    tx.commit().await?;
    let (same, past): (Option<bool>, bool) = (row.get(0), row.get(1));
    Ok(match same {
        Some(true) => Verdict::Committed,
        Some(false) => Verdict::RolledBack,
        None if past => Verdict::RolledBack,
        None => Verdict::InFlight,
    })
}

/// Marks events SENT once their halves were ended with a commit, in one statement.
pub async fn mark_sent(
    client: &impl GenericClient,
    sent: &[super::outbox::Sent],
) -> Result<u64, tokio_postgres::Error> {
    super::outbox::mark_sent_from(client, sent, OutboxStatus::Transaction.as_str()).await
}

/// Rows still TRANSACTION: created before `cutoff` (past the horizon) and since (within it).
pub async fn transaction_rows(
    client: &impl GenericClient,
    cutoff: DateTime<Utc>,
) -> Result<(u64, u64), tokio_postgres::Error> {
    let r = client
        .query_one(
            "SELECT count(*) FILTER (WHERE created_at < $1), count(*) FILTER (WHERE created_at >= $1)
             FROM event_outbox_by_day WHERE status = 'TRANSACTION'",
            &[&cutoff],
        )
        .await?;
    Ok((r.get::<_, i64>(0) as u64, r.get::<_, i64>(1) as u64))
}

/// Hands to the relay (PENDING, due now) up to `limit` rows still TRANSACTION that were
/// written before `cutoff`: their producer never marked them, and the broker stopped asking
/// long ago, so nothing else will deliver them. The broker may have delivered them after a
/// check-back: the relay's copy carries the same id, which the consumers' inboxes absorb.
/// Returns their event ids.
pub async fn requeue_stale(
    client: &impl GenericClient,
    cutoff: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "UPDATE event_outbox_by_day SET status = 'PENDING', next_attempt_at = now()
             WHERE (activity_id, event_id) IN (
                 SELECT activity_id, event_id FROM event_outbox_by_day
                 WHERE status = 'TRANSACTION' AND created_at < $1
                 ORDER BY created_at LIMIT $2
                 FOR UPDATE SKIP LOCKED)
               AND status = 'TRANSACTION'
             RETURNING event_id",
            &[&cutoff, &limit],
        )
        .await?;
    Ok(rows.into_iter().map(|r| r.get(0)).collect())
}
