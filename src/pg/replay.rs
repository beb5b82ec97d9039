//! An operator's replay in PostgreSQL (docs/architecture/recovery.md#dead-letters): what is
//! selected for it — dead letters, or quarantined messages a consumer could not read — what the
//! group's inbox says about it, and the audit row each attempt leaves (`dlq_audit`, which names a
//! dead letter, a quarantined message, or a message read from its source topic).

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

/// What a replay re-publishes: a dead letter or a quarantined message, by its row id, or a
/// message read from its source topic, by where the broker stored it
/// (`<topic>@<broker>:<queue>:<offset>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    DeadLetter(i64),
    Quarantined(i64),
    Source(String),
}

impl Subject {
    pub fn dlq_id(&self) -> Option<i64> {
        match self {
            Subject::DeadLetter(id) => Some(*id),
            _ => None,
        }
    }

    pub fn quarantine_id(&self) -> Option<i64> {
        match self {
            Subject::Quarantined(id) => Some(*id),
            _ => None,
        }
    }

    pub fn source_ref(&self) -> Option<&str> {
        match self {
            Subject::Source(at) => Some(at),
            _ => None,
        }
    }
}

impl std::fmt::Display for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Subject::DeadLetter(id) => write!(f, "dead letter {id}"),
            Subject::Quarantined(id) => write!(f, "quarantined message {id}"),
            Subject::Source(at) => write!(f, "stored message {at}"),
        }
    }
}

/// A message selected for replay, with what the re-publication needs.
#[derive(Debug, Clone)]
pub struct ReplayRow {
    pub subject: Subject,
    pub consumer_group: String,
    pub topic: String,
    pub message_id: Option<String>,
    pub reservation_id: Option<String>,
    pub order_id: Option<String>,
    pub payload: Vec<u8>,
    pub properties: serde_json::Value,
    /// When it was recorded (a dead letter's first sight, a quarantine's receipt).
    pub first_seen: DateTime<Utc>,
    pub status: String,
}

/// How replays are selected: by id, or by group and time window.
#[derive(Debug, Clone, Default)]
pub struct Selection<'a> {
    pub ids: &'a [i64],
    pub group: Option<&'a str>,
    pub since: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
    /// Quarantined messages only: this quarantine reason (`UNSUPPORTED_SCHEMA`, ...).
    pub quarantine_reason: Option<&'a str>,
}

/// A selected row: id, group, topic, message, reservation and order ids, payload, properties,
/// first seen, status (the column order both selections use).
fn replay_row(r: &tokio_postgres::Row, subject: fn(i64) -> Subject) -> ReplayRow {
    ReplayRow {
        subject: subject(r.get(0)),
        consumer_group: r.get(1),
        topic: r.get(2),
        message_id: r.get(3),
        reservation_id: r.get(4),
        order_id: r.get(5),
        payload: r.get(6),
        properties: r.get(7),
        first_seen: r.get(8),
        status: r.get(9),
    }
}

/// Selects dead letters by id, or by group and time window; OPEN ones, and REPLAYED ones
/// when named by id (a second replay is allowed: the inbox makes it a no-op).
pub async fn dead_letters(
    client: &impl GenericClient,
    sel: &Selection<'_>,
) -> Result<Vec<ReplayRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT dlq_id, consumer_group, topic, message_id, reservation_id, order_id, payload,
                    properties, first_seen, status
             FROM dlq_messages
             WHERE (cardinality($1::int8[]) > 0 AND dlq_id = ANY($1) AND status IN ('OPEN', 'REPLAYED'))
                OR (cardinality($1::int8[]) = 0 AND status = 'OPEN'
                    AND ($2::text IS NULL OR consumer_group = $2)
                    AND ($3::timestamptz IS NULL OR first_seen >= $3)
                    AND ($4::timestamptz IS NULL OR first_seen < $4))
             ORDER BY first_seen, dlq_id",
            &[&sel.ids, &sel.group, &sel.since, &sel.until],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| replay_row(r, Subject::DeadLetter))
        .collect())
}

/// Selects quarantined messages as [`dead_letters`] does: QUARANTINED ones, and REPLAYED ones
/// when named by id. The reservation and order ids come from the message's properties.
pub async fn quarantined(
    client: &impl GenericClient,
    sel: &Selection<'_>,
) -> Result<Vec<ReplayRow>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT quarantine_id, consumer_group, topic, message_id, properties->>'reservation_id',
                    properties->>'order_id', raw_body, properties, received_at, status
             FROM quarantined_messages
             WHERE (cardinality($1::int8[]) > 0 AND quarantine_id = ANY($1))
                OR (cardinality($1::int8[]) = 0 AND status = 'QUARANTINED'
                    AND ($2::text IS NULL OR consumer_group = $2)
                    AND ($3::timestamptz IS NULL OR received_at >= $3)
                    AND ($4::timestamptz IS NULL OR received_at < $4)
                    AND ($5::text IS NULL OR reason = $5))
             ORDER BY received_at, quarantine_id",
            &[
                &sel.ids,
                &sel.group,
                &sel.since,
                &sel.until,
                &sel.quarantine_reason,
            ],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| replay_row(r, Subject::Quarantined))
        .collect())
}

/// What the group's inbox holds for a message (`status`, `decision`): the message, or a copy
/// of it, was already processed.
pub async fn inbox_state(
    client: &impl GenericClient,
    group: &str,
    message_id: &str,
) -> Result<Option<(String, Option<String>)>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT status, decision FROM consumer_inbox_by_day
             WHERE consumer_group = $1 AND message_id = $2",
            &[&group, &message_id],
        )
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// Records what was observed after a replay on its audit row (`dlq_audit.effect`).
pub async fn record_effect(
    client: &impl GenericClient,
    replay_id: &str,
    effect: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE dlq_audit SET effect = $2 WHERE replay_id = $1",
            &[&replay_id, &effect],
        )
        .await
        .map(|_| ())
}

/// One replay attempt as the audit records it.
#[derive(Debug, Clone)]
pub struct ReplayAudit<'a> {
    pub subject: Subject,
    pub actor: &'a str,
    pub reason: &'a str,
    pub outcome: &'a str,
    pub replay_id: &'a str,
    /// The command's batch: every row one replay touched shares it.
    pub batch_id: &'a str,
    pub confirmed: bool,
    /// What the pre-checks found.
    pub checks: &'a serde_json::Value,
}

/// Records one replay attempt (and marks the row REPLAYED when the broker confirmed it).
pub async fn record(
    client: &mut tokio_postgres::Client,
    a: &ReplayAudit<'_>,
) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let marked = match &a.subject {
        Subject::DeadLetter(id) => Some((
            "UPDATE dlq_messages SET status = 'REPLAYED', updated_at = now() WHERE dlq_id = $1",
            *id,
        )),
        Subject::Quarantined(id) => Some((
            "UPDATE quarantined_messages SET status = 'REPLAYED', updated_at = now()
             WHERE quarantine_id = $1",
            *id,
        )),
        // Nothing of ours holds it: the audit row is its whole record.
        Subject::Source(_) => None,
    };
    if let (true, Some((sql, id))) = (a.confirmed, marked) {
        tx.execute(sql, &[&id]).await?;
    }
    tx.execute(
        "INSERT INTO dlq_audit
           (dlq_id, quarantine_id, source_ref, action, actor, reason, outcome, replay_id, checks,
            replay_batch_id)
         VALUES ($1, $2, $3, 'REPLAY', $4, $5, $6, $7, $8, $9)",
        &[
            &a.subject.dlq_id(),
            &a.subject.quarantine_id(),
            &a.subject.source_ref(),
            &a.actor,
            &a.reason,
            &a.outcome,
            &a.replay_id,
            &a.checks,
            &a.batch_id,
        ],
    )
    .await?;
    tx.commit().await
}
