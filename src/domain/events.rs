//! The events PostgreSQL originates (through the outbox), one serde type each, with the
//! deterministic id functions beside them (docs/architecture/messages.md#downstream-events).
//!
//! Producers (the order transaction, the state changes, reconcile) build these types and
//! nothing else; consumers (compensation, projection, timeout cancel) parse them. A field a
//! consumer does not need carries `#[serde(default)]`, so a consumer accepts exactly what it
//! accepted before; an optional field is left out of the payload when it has no value.
//!
//! Ids are deterministic: re-running a step (or reconcile) never mints a second event, and
//! every consumer deduplicates on them (the `message_id` property of the broker message).

use crate::domain::status::OrderStatus;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::order_create::SCHEMA_VERSION;

/// Broker tags of the outbox events: small, stable categories, never ids.
pub const TAG_ORDER_CREATED: &str = "ORDER_CREATED";
pub const TAG_ORDER_PAID: &str = "ORDER_PAID";
pub const TAG_ORDER_CANCELED: &str = "ORDER_CANCELED";
/// The tag of [`CancelOrderIfUnpaid`], whose `event_type` is `CANCEL_ORDER_IF_UNPAID`: the
/// shorter tag is what the broker, the dashboards and the alert rules already filter on.
pub const TAG_CANCEL_IF_UNPAID: &str = "CANCEL_IF_UNPAID";
pub const TAG_RELEASE_RESERVATION: &str = "RELEASE_RESERVATION";
pub const TAG_REFUND_REQUIRED: &str = "REFUND_REQUIRED";

pub const EVENT_ORDER_CREATED: &str = "ORDER_CREATED";
pub const EVENT_ORDER_PAID: &str = "ORDER_PAID";
pub const EVENT_ORDER_CANCELED: &str = "ORDER_CANCELED";
pub const EVENT_CANCEL_ORDER_IF_UNPAID: &str = "CANCEL_ORDER_IF_UNPAID";
pub const EVENT_RELEASE_RESERVATION: &str = "RELEASE_RESERVATION";
pub const EVENT_REFUND_REQUIRED: &str = "REFUND_REQUIRED";

/// Id of an order's ORDER_CREATED event (its version 1).
pub fn order_created_event_id(order_id: &str) -> String {
    format!("{order_id}.v1.ORDER_CREATED")
}
/// Id of the ORDER_PAID event that took the order to `version`.
pub fn order_paid_event_id(order_id: &str, version: i32) -> String {
    format!("{order_id}.v{version}.ORDER_PAID")
}
/// Id of the ORDER_CANCELED event that took the order to `version`.
pub fn order_canceled_event_id(order_id: &str, version: i32) -> String {
    format!("{order_id}.v{version}.ORDER_CANCELED")
}
/// Id of the timer message written with the order (delivered at `expires_at`).
pub fn cancel_if_unpaid_event_id(order_id: &str) -> String {
    format!("{order_id}.CANCEL_IF_UNPAID")
}
/// Id of the cancel trigger reconcile writes for an expired order nobody cancelled: distinct
/// from the original timer's, so it is delivered even if that one was, and stable, so a
/// second reconcile run writes nothing new.
pub fn reconcile_cancel_if_unpaid_event_id(order_id: &str) -> String {
    format!("{order_id}.CANCEL_IF_UNPAID.reconcile")
}
/// Inbox id of a cancel made by timeout-cancel's sweep over expired unpaid orders (the second
/// trigger, when the timer is late): stable per order, so two sweeps claim it once.
pub fn sweep_cancel_event_id(order_id: &str) -> String {
    format!("{order_id}.CANCEL_IF_UNPAID.sweep")
}
/// Id of a reservation's RELEASE_RESERVATION: one per reservation, whatever released it.
pub fn release_reservation_event_id(reservation_id: &str) -> String {
    format!("{reservation_id}.RELEASE_RESERVATION")
}
/// Id of the REFUND_REQUIRED event of a payment no order could take: one per payment id.
pub fn refund_required_event_id(order_id: &str, payment_id: &str) -> String {
    format!("{order_id}.{payment_id}.REFUND_REQUIRED")
}
/// Id of a reservation's compensation task row (unique per reservation).
pub fn compensation_task_id(reservation_id: &str) -> String {
    format!("cmp_{reservation_id}")
}

fn v1() -> i32 {
    SCHEMA_VERSION
}

/// What every order event carries: the projection reads only this.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderEventHeader {
    pub order_id: String,
    pub reservation_id: String,
    pub status: String,
    pub aggregate_version: i32,
    /// The buyer: the projection keeps it so that only they read it.
    pub user_id: i64,
}

/// Which order, whose and of what: the identity every order event and the buyer's view of an
/// order carry (flattened into both).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderRef {
    pub order_id: String,
    pub reservation_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
}

/// What every order event (ORDER_CREATED, ORDER_PAID, ORDER_CANCELED) carries, flattened into
/// each: the order's ids, its new status and the version the event takes it to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderEventBase {
    #[serde(default = "v1")]
    pub schema_version: i32,
    pub event_type: String,
    pub event_id: String,
    #[serde(flatten)]
    pub order: OrderRef,
    pub status: String,
    pub aggregate_version: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurred_at: Option<DateTime<Utc>>,
    /// Set when reconcile wrote the event because the original was missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconciled_at: Option<DateTime<Utc>>,
}

impl OrderEventBase {
    fn new(o: &OrderRef, event_type: &str, event_id: String, status: &str, v: i32) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: event_type.to_string(),
            event_id,
            order: o.clone(),
            status: status.to_string(),
            aggregate_version: v,
            occurred_at: None,
            reconciled_at: None,
        }
    }
}

/// ORDER_CREATED (order version 1), written by the order transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreated {
    #[serde(flatten)]
    pub base: OrderEventBase,
    pub expires_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

impl OrderCreated {
    pub fn new(o: &OrderRef, expires_at: DateTime<Utc>) -> Self {
        let id = order_created_event_id(&o.order_id);
        Self {
            base: OrderEventBase::new(o, EVENT_ORDER_CREATED, id, OrderStatus::Created.as_str(), 1),
            expires_at,
            traceparent: None,
        }
    }
}

/// ORDER_PAID, written by the payment's conditional update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPaid {
    #[serde(flatten)]
    pub base: OrderEventBase,
    pub payment_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub amount_cents: Option<i64>,
}

impl OrderPaid {
    pub fn new(o: &OrderRef, version: i32, payment_id: Option<String>) -> Self {
        let id = order_paid_event_id(&o.order_id, version);
        Self {
            base: OrderEventBase::new(o, EVENT_ORDER_PAID, id, OrderStatus::Paid.as_str(), version),
            payment_id,
            amount_cents: None,
        }
    }
}

/// ORDER_CANCELED, written by the timeout cancel's conditional update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCanceled {
    #[serde(flatten)]
    pub base: OrderEventBase,
    /// Why it was cancelled (`PAYMENT_TIMEOUT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl OrderCanceled {
    pub fn new(o: &OrderRef, version: i32) -> Self {
        let id = order_canceled_event_id(&o.order_id, version);
        Self {
            base: OrderEventBase::new(
                o,
                EVENT_ORDER_CANCELED,
                id,
                OrderStatus::Canceled.as_str(),
                version,
            ),
            reason: None,
        }
    }
}

/// REFUND_REQUIRED: the provider confirmed a payment the order could not take
/// (docs/architecture/recovery.md#refund-obligations); the shop owes it back. It rides on the
/// order's stream without moving the order: `status` and `aggregate_version` are the order's as the
/// payment found it, so a projection applying it by version changes nothing it should not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefundRequired {
    #[serde(flatten)]
    pub base: OrderEventBase,
    pub payment_id: String,
    /// What the buyer paid (the notification's amount), owed back.
    pub amount_cents: i64,
    /// `ORDER_CANCELED`, `ORDER_EXPIRED`, `ALREADY_PAID` or `AMOUNT_MISMATCH`.
    pub reason: String,
}

impl RefundRequired {
    /// `status`/`version`: the order's, unchanged by the refund.
    pub fn new(
        o: &OrderRef,
        status: &str,
        version: i32,
        payment_id: &str,
        amount_cents: i64,
        reason: &str,
    ) -> Self {
        let id = refund_required_event_id(&o.order_id, payment_id);
        Self {
            base: OrderEventBase::new(o, EVENT_REFUND_REQUIRED, id, status, version),
            payment_id: payment_id.to_string(),
            amount_cents,
            reason: reason.to_string(),
        }
    }
}

/// CANCEL_ORDER_IF_UNPAID: the timer message delivered at `expires_at` to `timeout-cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CancelOrderIfUnpaid {
    #[serde(default = "v1")]
    pub schema_version: i32,
    #[serde(default)]
    pub event_type: String,
    pub event_id: String,
    pub order_id: String,
    #[serde(default)]
    pub activity_id: i64,
    #[serde(default)]
    pub sku_id: i64,
    pub expires_at: DateTime<Utc>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconciled_at: Option<DateTime<Utc>>,
}

impl CancelOrderIfUnpaid {
    pub fn new(
        event_id: String,
        order_id: &str,
        activity_id: i64,
        sku_id: i64,
        expires_at: DateTime<Utc>,
    ) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: EVENT_CANCEL_ORDER_IF_UNPAID.to_string(),
            event_id,
            order_id: order_id.to_string(),
            activity_id,
            sku_id,
            expires_at,
            traceparent: None,
            reconciled_at: None,
        }
    }
}

/// RELEASE_RESERVATION: give a reservation's unit back to Redis (the compensation path), once
/// per reservation, after a rejection or a cancel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseReservation {
    #[serde(default = "v1")]
    pub schema_version: i32,
    #[serde(default)]
    pub event_type: String,
    #[serde(default)]
    pub event_id: String,
    pub reservation_id: String,
    #[serde(default)]
    pub order_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    #[serde(default)]
    pub user_id: i64,
    /// A rejection's code (`NO_STOCK`, `EXPIRED`, ...) or `ORDER_CANCELED`.
    #[serde(default)]
    pub reason: String,
    /// The ORDER_CREATE_REQUESTED message that was rejected, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occurred_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconciled_at: Option<DateTime<Utc>>,
}

impl ReleaseReservation {
    pub fn new(o: &OrderRef, reason: &str) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: EVENT_RELEASE_RESERVATION.to_string(),
            event_id: release_reservation_event_id(&o.reservation_id),
            reservation_id: o.reservation_id.clone(),
            order_id: o.order_id.clone(),
            activity_id: o.activity_id,
            sku_id: o.sku_id,
            user_id: o.user_id,
            reason: reason.to_string(),
            message_id: None,
            occurred_at: None,
            traceparent: None,
            reconciled_at: None,
        }
    }
}

/// An event as a JSON value for the outbox's `payload` column.
pub fn payload<T: Serialize>(event: &T) -> serde_json::Value {
    // Plain fields and timestamps: serialising cannot fail.
    serde_json::to_value(event).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn facts() -> OrderRef {
        OrderRef {
            order_id: "ord_1".into(),
            reservation_id: "rsv_1".into(),
            activity_id: 7,
            sku_id: 8,
            user_id: 9,
        }
    }

    #[test]
    fn event_ids_are_deterministic() {
        assert_eq!(order_created_event_id("ord_1"), "ord_1.v1.ORDER_CREATED");
        assert_eq!(order_paid_event_id("ord_1", 2), "ord_1.v2.ORDER_PAID");
        assert_eq!(
            order_canceled_event_id("ord_1", 2),
            "ord_1.v2.ORDER_CANCELED"
        );
        assert_eq!(cancel_if_unpaid_event_id("ord_1"), "ord_1.CANCEL_IF_UNPAID");
        assert_eq!(
            reconcile_cancel_if_unpaid_event_id("ord_1"),
            "ord_1.CANCEL_IF_UNPAID.reconcile"
        );
        assert_eq!(
            release_reservation_event_id("rsv_1"),
            "rsv_1.RELEASE_RESERVATION"
        );
        assert_eq!(compensation_task_id("rsv_1"), "cmp_rsv_1");
    }

    #[test]
    fn payloads_carry_exactly_their_fields() {
        let at = Utc::now();
        let mut created = OrderCreated::new(&facts(), at);
        created.base.occurred_at = Some(at);
        created.traceparent = Some("tp".into());
        assert_eq!(
            payload(&created),
            json!({
                "schema_version": 1, "event_type": "ORDER_CREATED",
                "event_id": "ord_1.v1.ORDER_CREATED", "order_id": "ord_1",
                "reservation_id": "rsv_1", "activity_id": 7, "sku_id": 8, "user_id": 9,
                "status": "CREATED", "aggregate_version": 1, "expires_at": at,
                "occurred_at": at, "traceparent": "tp",
            })
        );
        let release = ReleaseReservation::new(&facts(), "ORDER_CANCELED");
        assert_eq!(
            payload(&release),
            json!({
                "schema_version": 1, "event_type": "RELEASE_RESERVATION",
                "event_id": "rsv_1.RELEASE_RESERVATION", "reservation_id": "rsv_1",
                "order_id": "ord_1", "activity_id": 7, "sku_id": 8, "user_id": 9,
                "reason": "ORDER_CANCELED",
            })
        );
        // A payment reconcile re-emits without a payment id still says so.
        let paid = OrderPaid::new(&facts(), 2, None);
        assert_eq!(payload(&paid)["payment_id"], serde_json::Value::Null);
    }

    #[test]
    fn consumers_accept_the_fields_they_need_and_nothing_more() {
        let cancel: CancelOrderIfUnpaid = serde_json::from_value(json!({
            "event_id": "ord_1.CANCEL_IF_UNPAID", "order_id": "ord_1",
            "expires_at": "2026-01-01T00:00:00Z",
        }))
        .unwrap();
        assert_eq!(cancel.order_id, "ord_1");
        let release: ReleaseReservation = serde_json::from_value(json!({
            "reservation_id": "rsv_1", "activity_id": 1, "sku_id": 2,
        }))
        .unwrap();
        assert_eq!(release.reason, "");
        let header: OrderEventHeader = serde_json::from_value(json!({
            "order_id": "ord_1", "reservation_id": "rsv_1", "status": "PAID",
            "aggregate_version": 2, "payment_id": "p", "user_id": 7,
        }))
        .unwrap();
        assert_eq!((header.aggregate_version, header.user_id), (2, 7));
        assert!(serde_json::from_value::<CancelOrderIfUnpaid>(json!({"order_id": "x"})).is_err());
    }
}
