//! A created order's two events, ORDER_CREATED and CANCEL_ORDER_IF_UNPAID (its timer, due at
//! the payment deadline), written for the whole batch by one statement in which PostgreSQL
//! builds the documents (`jsonb_build_object`) from the batch's ids, as pgbench's batch script
//! does (bench/limits/order_batch.sql).
//!
//! Nearly every message writes these two. Serialised by the consumer they were ~770 bytes of
//! JSON per order to build, bind, send and have PostgreSQL parse again (BENCHMARKS.md, "The
//! order work's price", cut 12); now an order binds its ids, its buyer and its traceparent,
//! and the batch its two timestamps, formatted once. The field names live in the statement
//! below; the test `order_tx::outcomes::created_orders_events_are_the_event_structs_own_documents`
//! (tests/it) holds each document to `events::OrderCreated` and `events::CancelOrderIfUnpaid`
//! as serde writes them, so the event contract keeps one definition.

use chrono::{DateTime, SecondsFormat, Utc};
use tokio_postgres::types::ToSql;

use super::Batch;
use crate::domain::events::{
    cancel_if_unpaid_event_id, order_created_event_id, EVENT_CANCEL_ORDER_IF_UNPAID,
    EVENT_ORDER_CREATED, TAG_CANCEL_IF_UNPAID, TAG_ORDER_CREATED,
};
use crate::domain::order_create::SCHEMA_VERSION;
use crate::domain::OrderCreateRequested;
use crate::pg::rows::OutboxStart;
use crate::pg::statements::exec_unless_empty;

/// A batch's two instants as its documents write them: what `DateTime<Utc>`'s `Serialize`
/// writes (chrono's RFC 3339, AutoSi fractions, `Z` for UTC), formatted once per batch.
pub(super) struct DocTimes {
    occurred_at: String,
    expires_at: String,
}

impl DocTimes {
    pub(super) fn new(now: DateTime<Utc>, expires_at: DateTime<Utc>) -> Self {
        let text = |t: DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        Self {
            occurred_at: text(now),
            expires_at: text(expires_at),
        }
    }
}

/// Both events of every created order of a batch; a row already there (the same activity and
/// event id) is left as it is, as with every outbox insert. The order's own status and version
/// (`CREATED`, 1) are the event's; the timer is unversioned and first sent `$19`, shortly
/// before it is due (docs/architecture/recovery.md#outbox-relay). Both start as the relay's to send
/// (`OutboxStart::Pending`'s columns, `$20` and `$21`).
const INSERT_CREATED_EVENTS: &str = "INSERT INTO event_outbox_by_day
       (event_id, activity_id, topic, tag, message_key, aggregate_id, aggregate_version, payload,
        deliver_at, next_attempt_at, status, delivery, id_at)
     SELECT t.ce, t.ac, $9::text, $11::text, t.o, t.o, 1,
            jsonb_build_object('schema_version', $15::int4, 'event_type', $13::text,
                'event_id', t.ce, 'order_id', t.o, 'reservation_id', t.r, 'activity_id', t.ac,
                'sku_id', t.sk, 'user_id', t.u, 'status', 'CREATED', 'aggregate_version', 1,
                'occurred_at', $16::text, 'expires_at', $17::text, 'traceparent', t.tp),
            NULL, now(), $20::text, $21::text, t.at
     FROM unnest($1::text[], $2::text[], $3::text[], $5::int8[], $6::int8[], $7::int8[],
                 $8::text[], $22::timestamptz[]) AS t(o, r, ce, ac, sk, u, tp, at)
     UNION ALL
     SELECT t.xe, t.ac, $10::text, $12::text, t.o, t.o, NULL,
            jsonb_build_object('schema_version', $15::int4, 'event_type', $14::text,
                'event_id', t.xe, 'order_id', t.o, 'activity_id', t.ac, 'sku_id', t.sk,
                'expires_at', $17::text, 'traceparent', t.tp),
            $18::timestamptz, $19::timestamptz, $20::text, $21::text, t.at
     FROM unnest($1::text[], $4::text[], $5::int8[], $6::int8[], $8::text[], $23::timestamptz[])
          AS t(o, xe, ac, sk, tp, at)
     ON CONFLICT (activity_id, event_id, id_at) DO NOTHING";

/// The created orders' columns, borrowed from the batch's events but for the two event ids.
#[derive(Default)]
pub(super) struct CreatedEvents<'a> {
    order_ids: Vec<&'a str>,
    reservation_ids: Vec<&'a str>,
    created_ids: Vec<String>,
    cancel_ids: Vec<String>,
    activity_ids: Vec<i64>,
    sku_ids: Vec<i64>,
    user_ids: Vec<i64>,
    traceparents: Vec<&'a str>,
    /// The partition key of each event: the time in its id's ULID.
    created_at_ids: Vec<DateTime<Utc>>,
    cancel_at_ids: Vec<DateTime<Utc>>,
}

impl<'a> CreatedEvents<'a> {
    pub(super) fn with_capacity(orders: usize) -> Self {
        Self {
            order_ids: Vec::with_capacity(orders),
            reservation_ids: Vec::with_capacity(orders),
            created_ids: Vec::with_capacity(orders),
            cancel_ids: Vec::with_capacity(orders),
            activity_ids: Vec::with_capacity(orders),
            sku_ids: Vec::with_capacity(orders),
            user_ids: Vec::with_capacity(orders),
            traceparents: Vec::with_capacity(orders),
            created_at_ids: Vec::with_capacity(orders),
            cancel_at_ids: Vec::with_capacity(orders),
        }
    }

    pub(super) fn push(&mut self, e: &'a OrderCreateRequested) {
        self.order_ids.push(&e.order_id);
        self.reservation_ids.push(&e.reservation_id);
        let (created, cancel) = (
            order_created_event_id(&e.order_id),
            cancel_if_unpaid_event_id(&e.order_id),
        );
        self.created_at_ids
            .push(crate::domain::ids::id_at(&created));
        self.cancel_at_ids.push(crate::domain::ids::id_at(&cancel));
        self.created_ids.push(created);
        self.cancel_ids.push(cancel);
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
        self.traceparents.push(&e.trace.traceparent);
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order_ids.is_empty()
    }

    /// In the order transaction (the statement prepared once per connection).
    pub(super) async fn insert(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        b: &Batch<'_>,
    ) -> Result<(), tokio_postgres::Error> {
        let first_send_at = b.expires_at - b.names.timer_lead;
        let (status, delivery) = OutboxStart::Pending.columns();
        let params: [&(dyn ToSql + Sync); 23] = [
            &self.order_ids,
            &self.reservation_ids,
            &self.created_ids,
            &self.cancel_ids,
            &self.activity_ids,
            &self.sku_ids,
            &self.user_ids,
            &self.traceparents,
            &b.names.order_event_topic,
            &b.names.order_timeout_topic,
            &TAG_ORDER_CREATED,
            &TAG_CANCEL_IF_UNPAID,
            &EVENT_ORDER_CREATED,
            &EVENT_CANCEL_ORDER_IF_UNPAID,
            &SCHEMA_VERSION,
            &b.doc_times.occurred_at,
            &b.doc_times.expires_at,
            &b.expires_at,
            &first_send_at,
            &status,
            &delivery,
            &self.created_at_ids,
            &self.cancel_at_ids,
        ];
        exec_unless_empty(tx, self.is_empty(), INSERT_CREATED_EVENTS, params).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documents_times_are_written_as_serde_writes_an_instant() {
        // Whole seconds, milliseconds, nanoseconds: every fraction chrono writes.
        for nanos in [0, 120_000_000, 123_456_789] {
            let now = DateTime::from_timestamp(1_764_900_000, nanos).expect("instant");
            let expires_at = now + chrono::Duration::minutes(15);
            let times = DocTimes::new(now, expires_at);
            let serde = |t: DateTime<Utc>| serde_json::to_value(t).expect("serialises");
            assert_eq!(serde_json::Value::from(times.occurred_at), serde(now));
            assert_eq!(serde_json::Value::from(times.expires_at), serde(expires_at));
        }
    }
}
