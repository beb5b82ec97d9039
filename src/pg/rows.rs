//! The bookkeeping rows several transactions write, each table's insert written once: stock
//! ledger movements, compensation tasks and outbox events. Order creation
//! (`order_tx`), cancel (`cancel_tx`), payment (`order_state`) and reconcile fill these columns
//! and call `insert`, so the event contract and the ledger cannot drift between writers. Each
//! insert is one set-based statement (`unnest`), prepared once per connection on the hot paths.

use chrono::{DateTime, Utc};
use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;

use super::exec_unless_empty;
use crate::domain::events::compensation_task_id;

type Tx<'t> = deadpool_postgres::Transaction<'t>;

/// `stock_ledger`: one movement of one unit per order (a debit when it is created, a credit
/// when it is cancelled), from the bucket row it moved.
#[derive(Debug, Default)]
pub struct LedgerRows {
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    order_ids: Vec<String>,
    buckets: Vec<i16>,
    deltas: Vec<i32>,
    reasons: Vec<&'static str>,
}

/// Why the ledger moved.
#[derive(Debug, Clone, Copy)]
pub enum LedgerMove {
    /// A unit taken by a created order (-1).
    OrderCreated,
    /// A unit given back by a cancelled order (+1).
    OrderCanceled,
}

impl LedgerRows {
    pub fn push(
        &mut self,
        activity_id: i64,
        sku_id: i64,
        order_id: &str,
        bucket: i16,
        m: LedgerMove,
    ) {
        let (delta, reason) = match m {
            LedgerMove::OrderCreated => (-1, "ORDER_CREATED"),
            LedgerMove::OrderCanceled => (1, "ORDER_CANCELED"),
        };
        self.activity_ids.push(activity_id);
        self.sku_ids.push(sku_id);
        self.order_ids.push(order_id.to_string());
        self.buckets.push(bucket);
        self.deltas.push(delta);
        self.reasons.push(reason);
    }

    pub async fn insert(&self, tx: &Tx<'_>) -> Result<(), tokio_postgres::Error> {
        exec_unless_empty(
            tx,
            self.order_ids.is_empty(),
            "INSERT INTO stock_ledger (activity_id, sku_id, order_id, delta, reason, bucket)
             SELECT t.a, t.s, t.o, t.d, t.r, t.b
             FROM unnest($1::int8[], $2::int8[], $3::text[], $4::int2[], $5::int4[], $6::text[])
                  AS t(a, s, o, b, d, r)",
            [
                &self.activity_ids,
                &self.sku_ids,
                &self.order_ids,
                &self.buckets,
                &self.deltas,
                &self.reasons,
            ],
        )
        .await
    }
}

/// `compensation_tasks`: a reservation whose unit goes back to Redis, once (its task id is
/// derived from the reservation, so a second task for it is a no-op).
#[derive(Debug, Default)]
pub struct CompensationRows {
    task_ids: Vec<String>,
    reservation_ids: Vec<String>,
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    user_ids: Vec<i64>,
    reasons: Vec<String>,
}

impl CompensationRows {
    pub fn push(
        &mut self,
        reservation_id: &str,
        activity_id: i64,
        sku_id: i64,
        user_id: i64,
        reason: &str,
    ) {
        self.task_ids.push(compensation_task_id(reservation_id));
        self.reservation_ids.push(reservation_id.to_string());
        self.activity_ids.push(activity_id);
        self.sku_ids.push(sku_id);
        self.user_ids.push(user_id);
        self.reasons.push(reason.to_string());
    }

    pub fn is_empty(&self) -> bool {
        self.task_ids.is_empty()
    }

    pub async fn insert(&self, tx: &Tx<'_>) -> Result<(), tokio_postgres::Error> {
        exec_unless_empty(
            tx,
            self.is_empty(),
            "INSERT INTO compensation_tasks (task_id, reservation_id, activity_id, sku_id, user_id, reason)
             SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::text[])
             ON CONFLICT DO NOTHING",
            [
                &self.task_ids,
                &self.reservation_ids,
                &self.activity_ids,
                &self.sku_ids,
                &self.user_ids,
                &self.reasons,
            ],
        )
        .await
    }
}

/// How an outbox row starts (docs/ARCHITECTURE.md#delivering-events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxStart {
    /// Sent by the relay.
    Pending,
    /// Beside its stored half message: the producer ends it, the relay never claims it.
    Transaction,
}

/// One event for the outbox.
#[derive(Debug, Clone)]
pub struct OutboxEvent<'a> {
    pub event_id: String,
    pub activity_id: i64,
    pub topic: &'a str,
    pub tag: &'a str,
    pub key: &'a str,
    /// The aggregate the event belongs to, and its version (`None`: unversioned).
    pub aggregate: Option<(&'a str, Option<i32>)>,
    pub payload: serde_json::Value,
    /// A delayed message's delivery time.
    pub deliver_at: Option<DateTime<Utc>>,
    /// When the relay first sends it (`None`: at once, the database's `now()`).
    pub first_send_at: Option<DateTime<Utc>>,
    pub start: OutboxStart,
}

/// `event_outbox`: events written in the business transaction, in the order they are relayed.
#[derive(Debug, Default)]
pub struct OutboxRows {
    event_ids: Vec<String>,
    activity_ids: Vec<i64>,
    topics: Vec<String>,
    tags: Vec<String>,
    keys: Vec<String>,
    aggregate_ids: Vec<Option<String>>,
    versions: Vec<Option<i32>>,
    payloads: Vec<serde_json::Value>,
    deliver_at: Vec<Option<DateTime<Utc>>>,
    first_send_at: Vec<Option<DateTime<Utc>>>,
    statuses: Vec<&'static str>,
    deliveries: Vec<&'static str>,
}

/// The one insert of outbox rows; a row already there (the same activity and event id) is
/// left as it is.
const INSERT_OUTBOX: &str = "INSERT INTO event_outbox
       (event_id, activity_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
        deliver_at, next_attempt_at, status, delivery)
     SELECT t.e, t.ac, t.t, t.g, t.k, t.a, t.v, t.p, t.d, coalesce(t.n, now()), t.s, t.dl
     FROM unnest($1::text[], $2::int8[], $3::text[], $4::text[], $5::text[], $6::text[],
                 $7::int[], $8::jsonb[], $9::timestamptz[], $10::timestamptz[], $11::text[],
                 $12::text[])
          AS t(e, ac, t, g, k, a, v, p, d, n, s, dl)
     ON CONFLICT (activity_id, event_id) DO NOTHING";

impl OutboxRows {
    pub fn push(&mut self, e: OutboxEvent<'_>) {
        let (status, delivery) = match e.start {
            OutboxStart::Pending => ("PENDING", "outbox"),
            OutboxStart::Transaction => ("TRANSACTION", "transaction"),
        };
        self.event_ids.push(e.event_id);
        self.activity_ids.push(e.activity_id);
        self.topics.push(e.topic.to_string());
        self.tags.push(e.tag.to_string());
        self.keys.push(e.key.to_string());
        self.aggregate_ids
            .push(e.aggregate.map(|(id, _)| id.to_string()));
        self.versions.push(e.aggregate.and_then(|(_, v)| v));
        self.payloads.push(e.payload);
        self.deliver_at.push(e.deliver_at);
        self.first_send_at.push(e.first_send_at);
        self.statuses.push(status);
        self.deliveries.push(delivery);
    }

    pub fn is_empty(&self) -> bool {
        self.event_ids.is_empty()
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 12] {
        [
            &self.event_ids,
            &self.activity_ids,
            &self.topics,
            &self.tags,
            &self.keys,
            &self.aggregate_ids,
            &self.versions,
            &self.payloads,
            &self.deliver_at,
            &self.first_send_at,
            &self.statuses,
            &self.deliveries,
        ]
    }

    /// In a hot-path transaction (the statement prepared once per connection).
    pub async fn insert(&self, tx: &Tx<'_>) -> Result<(), tokio_postgres::Error> {
        exec_unless_empty(tx, self.is_empty(), INSERT_OUTBOX, self.params()).await
    }

    /// With any client (payment, reconcile); returns the rows written.
    pub async fn insert_with(
        &self,
        client: &impl GenericClient,
    ) -> Result<u64, tokio_postgres::Error> {
        if self.is_empty() {
            return Ok(0);
        }
        client.execute(INSERT_OUTBOX, &self.params()).await
    }
}
