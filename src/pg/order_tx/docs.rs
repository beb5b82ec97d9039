//! The two event documents of a created order, as the order transaction writes them: the
//! fields of `events::OrderCreated` and `events::CancelOrderIfUnpaid`, in their order,
//! borrowed from the batch's event, with the batch's two timestamps formatted once.
//!
//! Nearly every message writes these two. Built through the event structs they cost ten
//! string copies and three timestamp formattings per order, a tenth of the consumer's CPU
//! (BENCHMARKS.md, "The order work's price"). The test below holds both documents to the
//! event structs' own serialisation, byte for byte: the event contract has one definition.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use crate::domain::events::{EVENT_CANCEL_ORDER_IF_UNPAID, EVENT_ORDER_CREATED};
use crate::domain::order_create::SCHEMA_VERSION;
use crate::domain::OrderCreateRequested;

/// A batch's two instants as its documents write them (chrono's own RFC 3339 form).
pub(super) struct DocTimes {
    occurred_at: String,
    expires_at: String,
}

impl DocTimes {
    pub(super) fn new(now: DateTime<Utc>, expires_at: DateTime<Utc>) -> Self {
        // What `DateTime<Utc>`'s Serialize writes: AutoSi fractions, `Z` for UTC.
        let text = |t: DateTime<Utc>| t.to_rfc3339_opts(SecondsFormat::AutoSi, true);
        Self {
            occurred_at: text(now),
            expires_at: text(expires_at),
        }
    }
}

/// ORDER_CREATED (`events::OrderCreated`, order version 1).
#[derive(Serialize)]
pub(super) struct CreatedDoc<'a> {
    schema_version: i32,
    event_type: &'static str,
    event_id: &'a str,
    order_id: &'a str,
    reservation_id: &'a str,
    activity_id: i64,
    sku_id: i64,
    user_id: i64,
    status: &'static str,
    aggregate_version: i32,
    occurred_at: &'a str,
    expires_at: &'a str,
    traceparent: &'a str,
}

impl<'a> CreatedDoc<'a> {
    pub(super) fn new(e: &'a OrderCreateRequested, event_id: &'a str, t: &'a DocTimes) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: EVENT_ORDER_CREATED,
            event_id,
            order_id: &e.order_id,
            reservation_id: &e.reservation_id,
            activity_id: e.activity_id,
            sku_id: e.sku_id,
            user_id: e.user_id,
            status: "CREATED",
            aggregate_version: 1,
            occurred_at: &t.occurred_at,
            expires_at: &t.expires_at,
            traceparent: &e.trace.traceparent,
        }
    }
}

/// CANCEL_ORDER_IF_UNPAID (`events::CancelOrderIfUnpaid`), due at the order's deadline.
#[derive(Serialize)]
pub(super) struct CancelDoc<'a> {
    schema_version: i32,
    event_type: &'static str,
    event_id: &'a str,
    order_id: &'a str,
    activity_id: i64,
    sku_id: i64,
    expires_at: &'a str,
    traceparent: &'a str,
}

impl<'a> CancelDoc<'a> {
    pub(super) fn new(e: &'a OrderCreateRequested, event_id: &'a str, t: &'a DocTimes) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: EVENT_CANCEL_ORDER_IF_UNPAID,
            event_id,
            order_id: &e.order_id,
            activity_id: e.activity_id,
            sku_id: e.sku_id,
            expires_at: &t.expires_at,
            traceparent: &e.trace.traceparent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::events::{
        cancel_if_unpaid_event_id, order_created_event_id, CancelOrderIfUnpaid, OrderCreated,
        OrderRef,
    };
    use crate::pg::rows::JsonDoc;

    #[test]
    fn created_documents_are_the_events_own_byte_for_byte() {
        let e = crate::domain::order_create::tests::sample();
        // Whole seconds, milliseconds, nanoseconds: every fraction chrono writes.
        for nanos in [0, 120_000_000, 123_456_789] {
            let now = DateTime::from_timestamp(1_764_900_000, nanos).expect("instant");
            let expires_at = now + chrono::Duration::minutes(15);
            let times = DocTimes::new(now, expires_at);
            let facts = OrderRef {
                order_id: e.order_id.clone(),
                reservation_id: e.reservation_id.clone(),
                activity_id: e.activity_id,
                sku_id: e.sku_id,
                user_id: e.user_id,
            };
            let mut created = OrderCreated::new(&facts, expires_at);
            created.base.occurred_at = Some(now);
            created.traceparent = Some(e.trace.traceparent.clone());
            let id = order_created_event_id(&e.order_id);
            assert_eq!(
                JsonDoc::of(&CreatedDoc::new(&e, &id, &times)).as_str(),
                JsonDoc::of(&created).as_str()
            );

            let id = cancel_if_unpaid_event_id(&e.order_id);
            let mut cancel = CancelOrderIfUnpaid::new(
                id.clone(),
                &e.order_id,
                e.activity_id,
                e.sku_id,
                expires_at,
            );
            cancel.traceparent = Some(e.trace.traceparent.clone());
            assert_eq!(
                JsonDoc::of(&CancelDoc::new(&e, &id, &times)).as_str(),
                JsonDoc::of(&cancel).as_str()
            );
        }
    }
}
