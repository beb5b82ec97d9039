//! The bookkeeping rows several transactions write, each table's insert written once: stock
//! ledger movements, compensation tasks and outbox events. Order creation
//! (`order_tx`), cancel (`cancel_tx`), payment (`order_state`) and reconcile fill these columns
//! and call `insert`, so the event contract and the ledger cannot drift between writers. Each
//! insert is one set-based statement (`unnest`), prepared once per connection on the hot paths.

use crate::domain::status::OutboxStatus;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::types::{IsNull, ToSql, Type};
use tokio_postgres::GenericClient;

use super::statements::exec_unless_empty;
use crate::domain::events::{compensation_task_id, ReleaseReservation, TAG_RELEASE_RESERVATION};

type Tx<'t> = deadpool_postgres::Transaction<'t>;

mod inbox;
pub use inbox::{InboxClaims, InboxOutcomes, Returned};

/// `stock_ledger`: one movement of one unit per order (a debit when it is created, a credit
/// when it is cancelled), from the bucket row it moved.
#[derive(Debug, Default)]
pub struct LedgerRows<'a> {
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    order_ids: Vec<&'a str>,
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

impl<'a> LedgerRows<'a> {
    pub fn push(
        &mut self,
        activity_id: i64,
        sku_id: i64,
        order_id: &'a str,
        bucket: i16,
        m: LedgerMove,
    ) {
        let (delta, reason) = match m {
            LedgerMove::OrderCreated => (-1, "ORDER_CREATED"),
            LedgerMove::OrderCanceled => (1, "ORDER_CANCELED"),
        };
        self.activity_ids.push(activity_id);
        self.sku_ids.push(sku_id);
        self.order_ids.push(order_id);
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

/// How an outbox row starts (docs/architecture/messages.md#delivering-events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxStart {
    /// Sent by the relay.
    Pending,
    /// Beside its stored half message: the producer ends it, the relay never claims it.
    Transaction,
}

impl OutboxStart {
    /// The row's `(status, delivery)` columns.
    pub fn columns(self) -> (&'static str, &'static str) {
        match self {
            OutboxStart::Pending => (OutboxStatus::Pending.as_str(), "outbox"),
            OutboxStart::Transaction => (OutboxStatus::Transaction.as_str(), "transaction"),
        }
    }
}

/// An event's JSON document, serialised once straight from its struct and bound as `jsonb`
/// (no `serde_json::Value` tree built, walked and dropped on the way: on the order
/// transaction's path that was a tenth of the consumer's CPU, BENCHMARKS.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonDoc(Vec<u8>);

/// Room for one event's document in one allocation (they are 300 to 500 bytes): written
/// into a growing buffer it was allocated five times over.
const DOC_CAPACITY: usize = 512;

impl JsonDoc {
    pub fn of<T: Serialize>(event: &T) -> Self {
        let mut doc = Vec::with_capacity(DOC_CAPACITY);
        // Plain fields and timestamps: serialising cannot fail.
        if serde_json::to_writer(&mut doc, event).is_err() {
            doc = b"null".to_vec();
        }
        Self(doc)
    }

    pub fn as_str(&self) -> &str {
        // serde_json writes UTF-8 only.
        std::str::from_utf8(&self.0).unwrap_or("null")
    }
}

impl From<&serde_json::Value> for JsonDoc {
    fn from(v: &serde_json::Value) -> Self {
        Self(v.to_string().into_bytes())
    }
}

impl ToSql for JsonDoc {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        // jsonb's binary form: a version byte (1), then the document's text.
        out.extend_from_slice(&[1]);
        out.extend_from_slice(&self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }

    tokio_postgres::types::to_sql_checked!();
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
    pub payload: JsonDoc,
    /// A delayed message's delivery time.
    pub deliver_at: Option<DateTime<Utc>>,
    /// When the relay first sends it (`None`: at once, the database's `now()`).
    pub first_send_at: Option<DateTime<Utc>>,
    pub start: OutboxStart,
}

impl<'a> OutboxEvent<'a> {
    /// A RELEASE_RESERVATION on the compensation topic, keyed by its reservation: the unit goes
    /// back to Redis through the compensation consumer; unversioned, relayed at once.
    pub fn release(release: &ReleaseReservation, topic: &'a str, key: &'a str) -> Self {
        OutboxEvent {
            event_id: release.event_id.clone(),
            activity_id: release.activity_id,
            topic,
            tag: TAG_RELEASE_RESERVATION,
            key,
            aggregate: None,
            payload: JsonDoc::of(release),
            deliver_at: None,
            first_send_at: None,
            start: OutboxStart::Pending,
        }
    }
}

/// `event_outbox`: events written in the business transaction, in the order they are relayed.
/// Topics, tags, keys and aggregate ids are borrowed from the caller's events.
#[derive(Debug, Default)]
pub struct OutboxRows<'a> {
    event_ids: Vec<String>,
    activity_ids: Vec<i64>,
    topics: Vec<&'a str>,
    tags: Vec<&'a str>,
    keys: Vec<&'a str>,
    aggregate_ids: Vec<Option<&'a str>>,
    versions: Vec<Option<i32>>,
    payloads: Vec<JsonDoc>,
    deliver_at: Vec<Option<DateTime<Utc>>>,
    first_send_at: Vec<Option<DateTime<Utc>>>,
    statuses: Vec<&'static str>,
    deliveries: Vec<&'static str>,
    /// The partition key: the time in each event id's ULID.
    id_ats: Vec<DateTime<Utc>>,
}

/// The one insert of outbox rows; a row already there (the same activity and event id) is
/// left as it is.
const INSERT_OUTBOX: &str = "INSERT INTO event_outbox_by_day
       (event_id, activity_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
        deliver_at, next_attempt_at, status, delivery, id_at)
     SELECT t.e, t.ac, t.t, t.g, t.k, t.a, t.v, t.p, t.d, coalesce(t.n, now()), t.s, t.dl, t.at
     FROM unnest($1::text[], $2::int8[], $3::text[], $4::text[], $5::text[], $6::text[],
                 $7::int[], $8::jsonb[], $9::timestamptz[], $10::timestamptz[], $11::text[],
                 $12::text[], $13::timestamptz[])
          AS t(e, ac, t, g, k, a, v, p, d, n, s, dl, at)
     ON CONFLICT (activity_id, event_id, id_at) DO NOTHING";

impl<'a> OutboxRows<'a> {
    /// Room for `rows` rows without growing.
    pub fn with_capacity(rows: usize) -> Self {
        Self {
            event_ids: Vec::with_capacity(rows),
            activity_ids: Vec::with_capacity(rows),
            topics: Vec::with_capacity(rows),
            tags: Vec::with_capacity(rows),
            keys: Vec::with_capacity(rows),
            aggregate_ids: Vec::with_capacity(rows),
            versions: Vec::with_capacity(rows),
            payloads: Vec::with_capacity(rows),
            deliver_at: Vec::with_capacity(rows),
            first_send_at: Vec::with_capacity(rows),
            statuses: Vec::with_capacity(rows),
            deliveries: Vec::with_capacity(rows),
            id_ats: Vec::with_capacity(rows),
        }
    }

    pub fn push(&mut self, e: OutboxEvent<'a>) {
        let (status, delivery) = e.start.columns();
        self.id_ats.push(crate::domain::ids::id_at(&e.event_id));
        self.event_ids.push(e.event_id);
        self.activity_ids.push(e.activity_id);
        self.topics.push(e.topic);
        self.tags.push(e.tag);
        self.keys.push(e.key);
        self.aggregate_ids.push(e.aggregate.map(|(id, _)| id));
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

    fn params(&self) -> [&(dyn ToSql + Sync); 13] {
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
            &self.id_ats,
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

/// `quarantined_messages`: bodies a consumer can never read, kept raw with their properties
/// and why, for an operator (`seckill dlq list --quarantined`).
#[derive(Debug, Default)]
pub struct QuarantineRows {
    message_ids: Vec<Option<String>>,
    broker_msg_ids: Vec<String>,
    reasons: Vec<String>,
    errors: Vec<String>,
    bodies: Vec<Vec<u8>>,
    properties: Vec<serde_json::Value>,
    attempts: Vec<i32>,
}

/// The quarantine rows: `$1` the group, `$2` the topic, then one array per column.
const INSERT_QUARANTINE: &str = "INSERT INTO quarantined_messages
       (consumer_group, topic, message_id, broker_msg_id, reason, error, raw_body,
        properties, delivery_attempt)
     SELECT $1, $2, t.m, t.b, t.r, t.e, t.body, t.p, t.a
     FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::bytea[],
                 $8::jsonb[], $9::int[]) AS t(m, b, r, e, body, p, a)";

/// One unreadable message.
#[derive(Debug)]
pub struct Poison {
    pub message_id: Option<String>,
    pub broker_msg_id: String,
    pub reason: String,
    pub error: String,
    pub body: Vec<u8>,
    pub properties: serde_json::Value,
    pub delivery_attempt: i32,
}

impl QuarantineRows {
    pub fn push(&mut self, p: Poison) {
        self.message_ids.push(p.message_id);
        self.broker_msg_ids.push(p.broker_msg_id);
        self.reasons.push(p.reason);
        self.errors.push(p.error);
        self.bodies.push(p.body);
        self.properties.push(p.properties);
        self.attempts.push(p.delivery_attempt);
    }

    pub fn is_empty(&self) -> bool {
        self.broker_msg_ids.is_empty()
    }

    fn params<'a>(&'a self, group: &'a &'a str, topic: &'a &'a str) -> [&'a (dyn ToSql + Sync); 9] {
        [
            group,
            topic,
            &self.message_ids,
            &self.broker_msg_ids,
            &self.reasons,
            &self.errors,
            &self.bodies,
            &self.properties,
            &self.attempts,
        ]
    }

    /// In the order transaction (the statement prepared once per connection).
    pub async fn insert(
        &self,
        tx: &Tx<'_>,
        group: &str,
        topic: &str,
    ) -> Result<(), tokio_postgres::Error> {
        let params = self.params(&group, &topic);
        exec_unless_empty(tx, self.is_empty(), INSERT_QUARANTINE, params).await
    }

    /// With any client (a consumer outside a transaction); returns the rows written.
    pub async fn insert_with(
        &self,
        client: &impl GenericClient,
        group: &str,
        topic: &str,
    ) -> Result<u64, tokio_postgres::Error> {
        if self.is_empty() {
            return Ok(0);
        }
        client
            .execute(INSERT_QUARANTINE, &self.params(&group, &topic))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::events::{payload, OrderCreated, OrderRef};

    #[test]
    fn a_json_doc_is_the_document_the_value_tree_was() {
        let facts = OrderRef {
            order_id: "ord_1".into(),
            reservation_id: "rsv_1".into(),
            activity_id: 7,
            sku_id: 8,
            user_id: 9,
        };
        let at = Utc::now();
        let mut created = OrderCreated::new(&facts, at);
        created.base.occurred_at = Some(at);
        created.traceparent = Some("tp".into());
        let doc = JsonDoc::of(&created);
        let parsed: serde_json::Value = serde_json::from_str(doc.as_str()).expect("JSON");
        assert_eq!(parsed, payload(&created));
        assert_eq!(
            JsonDoc::from(&payload(&created)),
            JsonDoc(payload(&created).to_string().into_bytes())
        );
        // Bound as jsonb only: its binary form is the version byte, then the text.
        assert!(JsonDoc::accepts(&Type::JSONB));
        assert!(!JsonDoc::accepts(&Type::TEXT));
        let mut out = bytes::BytesMut::new();
        doc.to_sql(&Type::JSONB, &mut out).expect("encodes");
        assert_eq!(out[0], 1);
        assert_eq!(&out[1..], doc.as_str().as_bytes());
    }
}
