//! The inbox rows of a consuming transaction: the claim of each message (its first writer owns
//! its effect) and the outcomes written in the same transaction.

use crate::domain::status::InboxStatus;
use std::collections::HashSet;

use tokio_postgres::types::ToSql;

/// `consumer_inbox`, first half: the messages one transaction claims. A row already there
/// (`ON CONFLICT DO NOTHING`) means another transaction processed that message: a duplicate.
#[derive(Debug, Default)]
pub struct InboxClaims<'a> {
    message_ids: Vec<&'a str>,
    reservation_ids: Vec<Option<&'a str>>,
    order_ids: Vec<&'a str>,
    attempts: Vec<i32>,
    activity_ids: Vec<Option<i64>>,
    statuses: Vec<&'static str>,
    decisions: Vec<Option<&'a str>>,
    /// The partition key: the time in each message id's ULID.
    id_ats: Vec<chrono::DateTime<chrono::Utc>>,
}

/// The claim: the row's activity is the message's, or (when the message does not carry it)
/// the order's, looked up in the same statement. A row starts `PROCESSING`, or with the
/// outcome its transaction expects ([`InboxClaims::push`]); no other transaction sees it
/// before the commit, and the transaction corrects the rows that came to something else.
const CLAIM_INBOX: &str = "INSERT INTO consumer_inbox_by_day
       (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
        delivery_attempt, activity_id, id_at)
     SELECT $1, t.m, $2, t.r, t.o, t.st, t.d, t.a,
            coalesce(t.act, (SELECT o.activity_id FROM orders o WHERE o.order_id = t.o LIMIT 1), 0),
            t.at
     FROM unnest($3::text[], $4::text[], $5::text[], $6::int[], $7::int8[], $8::text[],
                 $9::text[], $10::timestamptz[]) AS t(m, r, o, a, act, st, d, at)
     ON CONFLICT DO NOTHING
     RETURNING message_id";

impl<'a> InboxClaims<'a> {
    /// One message to claim; `expected`: the outcome (`SUCCEEDED` or `REJECTED`, and the
    /// decision) its row starts with instead of `PROCESSING`, so that when it holds the row is
    /// written once.
    pub fn push(
        &mut self,
        message_id: &'a str,
        reservation_id: Option<&'a str>,
        order_id: &'a str,
        delivery_attempt: i32,
        activity_id: Option<i64>,
        expected: Option<(&'static str, &'a str)>,
    ) {
        self.message_ids.push(message_id);
        self.id_ats.push(crate::domain::ids::id_at(message_id));
        self.reservation_ids.push(reservation_id);
        self.order_ids.push(order_id);
        self.attempts.push(delivery_attempt);
        self.activity_ids.push(activity_id);
        let (status, decision) = match expected {
            Some((status, decision)) => (status, Some(decision)),
            None => (InboxStatus::Processing.as_str(), None),
        };
        self.statuses.push(status);
        self.decisions.push(decision);
    }

    /// Claims every row in one statement; returns the message ids this transaction now owns.
    /// The ids pushed must be distinct.
    pub async fn claim(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        consumer_group: &str,
        topic: &str,
    ) -> Result<Returned, tokio_postgres::Error> {
        if self.message_ids.is_empty() {
            return Ok(Returned::All);
        }
        let stmt = tx.prepare_cached(CLAIM_INBOX).await?;
        let params: [&(dyn ToSql + Sync); 10] = [
            &consumer_group,
            &topic,
            &self.message_ids,
            &self.reservation_ids,
            &self.order_ids,
            &self.attempts,
            &self.activity_ids,
            &self.statuses,
            &self.decisions,
            &self.id_ats,
        ];
        let rows = tx.query(&stmt, &params).await?;
        Ok(Returned::of(rows, self.message_ids.len()))
    }
}

/// The rows an `INSERT ... ON CONFLICT DO NOTHING RETURNING <id>` wrote, for rows whose ids
/// are distinct. When every row came back (nearly every batch) no id is read out of the
/// answer; otherwise the ids returned, as a set.
#[derive(Debug)]
pub enum Returned {
    /// Every row sent was written.
    All,
    /// Only these were.
    Only(HashSet<String>),
}

impl Returned {
    /// `rows` answered a statement that sent `sent` rows of distinct ids.
    pub fn of(rows: Vec<tokio_postgres::Row>, sent: usize) -> Self {
        if rows.len() == sent {
            return Returned::All;
        }
        Returned::Only(rows.into_iter().map(|r| r.get::<_, String>(0)).collect())
    }

    /// Whether the row of `id` (one of those sent) was written.
    pub fn contains(&self, id: &str) -> bool {
        match self {
            Returned::All => true,
            Returned::Only(ids) => ids.contains(id),
        }
    }
}

/// `consumer_inbox`, second half: what each owned message came to (its status and decision),
/// written in the same transaction.
#[derive(Debug, Default)]
pub struct InboxOutcomes {
    message_ids: Vec<String>,
    statuses: Vec<&'static str>,
    decisions: Vec<String>,
}

/// One statement for the batch: each row found with `message_id = ANY($2)`, its values taken
/// from the same position of `$3` and `$4`. Before the inbox has statistics (a fresh schema, a
/// new deployment) PostgreSQL may read the group's whole index range and filter it; the order
/// transaction sends it only for its corrections, planned per run
/// (docs/architecture/order-creation.md#planning-once).
const SETTLE_INBOX: &str = "UPDATE consumer_inbox_by_day
        SET status = ($3::text[])[array_position($2::text[], message_id)],
            decision = ($4::text[])[array_position($2::text[], message_id)],
            updated_at = now()
      WHERE consumer_group = $1 AND message_id = ANY($2::text[])";

impl InboxOutcomes {
    /// `message_id` once per batch (the claim made them unique).
    pub fn push(&mut self, message_id: String, status: &'static str, decision: String) {
        self.message_ids.push(message_id);
        self.statuses.push(status);
        self.decisions.push(decision);
    }

    /// The outcomes, in one statement prepared once per connection (`per_run`: for this run
    /// only, planned with these ids: [`crate::pg::statements::Sql::PerRun`]).
    pub async fn settle(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        consumer_group: &str,
        per_run: bool,
    ) -> Result<(), tokio_postgres::Error> {
        use tokio_postgres::types::Type;
        const TYPES: [Type; 4] = [
            Type::TEXT,
            Type::TEXT_ARRAY,
            Type::TEXT_ARRAY,
            Type::TEXT_ARRAY,
        ];
        let sql = match per_run {
            true => crate::pg::statements::Sql::PerRun(SETTLE_INBOX, &TYPES),
            false => crate::pg::statements::Sql::Cached(SETTLE_INBOX),
        };
        crate::pg::statements::exec_unless_empty(
            tx,
            self.message_ids.is_empty(),
            sql,
            [
                &consumer_group,
                &self.message_ids,
                &self.statuses,
                &self.decisions,
            ],
        )
        .await
    }
}
