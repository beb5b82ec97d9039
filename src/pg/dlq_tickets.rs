//! `dlq_tickets`: one ticket per group of failures, and its delivery to the ticket hook
//! (docs/RUNBOOK.md#dead-letter-tickets).

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

/// A ticket to deliver.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub fingerprint: String,
    pub consumer_group: String,
    pub source: String,
    pub owner: String,
    pub message: String,
    pub failures: i32,
    pub opened_at: DateTime<Utc>,
    pub attempts: i32,
}

/// Opens a ticket for a group unless one was ever opened for its fingerprint; `true` when
/// this call opened it.
pub async fn open(client: &impl GenericClient, t: &Ticket) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "INSERT INTO dlq_tickets (fingerprint, consumer_group, source, owner, message, failures)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT DO NOTHING",
            &[
                &t.fingerprint,
                &t.consumer_group,
                &t.source,
                &t.owner,
                &t.message,
                &t.failures,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// Takes up to `limit` undelivered tickets whose attempt is due, pushing each one's next
/// attempt back (2^attempts seconds, at most 5 minutes), so that two instances never post the
/// same ticket at once; `attempts` counts this one.
pub async fn claim_due(
    client: &impl GenericClient,
    limit: i64,
) -> Result<Vec<Ticket>, tokio_postgres::Error> {
    let rows = client
        .query(
            "UPDATE dlq_tickets t
             SET attempts = t.attempts + 1,
                 next_attempt_at = now() + least(power(2, t.attempts + 1), 300) * interval '1 second'
             WHERE t.fingerprint IN (
                 SELECT fingerprint FROM dlq_tickets
                 WHERE delivered_at IS NULL AND next_attempt_at <= now()
                 ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED)
             RETURNING t.fingerprint, t.consumer_group, t.source, t.owner, t.message, t.failures,
                       t.opened_at, t.attempts",
            &[&limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Ticket {
            fingerprint: r.get(0),
            consumer_group: r.get(1),
            source: r.get(2),
            owner: r.get(3),
            message: r.get(4),
            failures: r.get(5),
            opened_at: r.get(6),
            attempts: r.get(7),
        })
        .collect())
}

/// Records the hook's answer: delivered, or why not (tried again at `next_attempt_at`).
pub async fn record(
    client: &impl GenericClient,
    fingerprint: &str,
    error: Option<&str>,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE dlq_tickets
             SET delivered_at = CASE WHEN $2::text IS NULL THEN now() END, last_error = $2
             WHERE fingerprint = $1",
            &[&fingerprint, &error],
        )
        .await
        .map(|_| ())
}
