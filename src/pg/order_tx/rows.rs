//! The column arrays of the order transaction's set-based (`unnest`) statements, one struct
//! per statement, each filled from the batch's events.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use tokio_postgres::types::ToSql;

use super::{Batch, Inbound};
use crate::domain::event::PoisonReason;
use crate::domain::events::{
    cancel_if_unpaid_event_id, compensation_task_id, payload, CancelOrderIfUnpaid, OrderCreated,
    OrderRef, ReleaseReservation, TAG_CANCEL_IF_UNPAID, TAG_ORDER_CREATED, TAG_RELEASE_RESERVATION,
};
use crate::domain::{Decision, OrderCreateRequested, RejectReason};

/// `quarantined_messages`: poison with its raw body.
#[derive(Default)]
pub(super) struct QuarantineRows {
    pub(super) message_ids: Vec<Option<String>>,
    pub(super) broker_msg_ids: Vec<String>,
    pub(super) reasons: Vec<String>,
    pub(super) errors: Vec<String>,
    pub(super) bodies: Vec<Vec<u8>>,
    pub(super) properties: Vec<serde_json::Value>,
    pub(super) attempts: Vec<i32>,
}

impl QuarantineRows {
    pub(super) fn push(&mut self, item: &Inbound, reason: &PoisonReason) {
        self.message_ids.push(item.property_message_id.clone());
        self.broker_msg_ids.push(item.broker_msg_id.clone());
        self.reasons.push(reason.code().to_string());
        self.errors.push(reason.to_string());
        self.bodies.push(item.raw_body.clone());
        self.properties.push(item.properties.clone());
        self.attempts.push(item.delivery_attempt);
    }
}

/// `reservations`: the decision row of each reservation (`ORDERED`, or `REJECTED` with why).
#[derive(Default)]
pub(super) struct ReservationRows {
    pub(super) reservation_ids: Vec<String>,
    pub(super) message_ids: Vec<String>,
    pub(super) request_ids: Vec<String>,
    pub(super) order_ids: Vec<String>,
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) user_ids: Vec<i64>,
    pub(super) reject_reasons: Vec<Option<String>>,
    pub(super) reserved_at: Vec<DateTime<Utc>>,
    pub(super) valid_until: Vec<DateTime<Utc>>,
}

impl ReservationRows {
    pub(super) fn push(&mut self, e: &OrderCreateRequested, early: Option<RejectReason>) {
        self.reservation_ids.push(e.reservation_id.clone());
        self.message_ids.push(e.message_id.clone());
        self.request_ids.push(e.request_id.clone());
        self.order_ids.push(e.order_id.clone());
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
        self.reject_reasons
            .push(early.map(|r| r.code().to_string()));
        self.reserved_at.push(e.reservation_created_at);
        self.valid_until.push(e.reservation_valid_until);
    }

    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 10] {
        [
            &self.reservation_ids,
            &self.message_ids,
            &self.request_ids,
            &self.order_ids,
            &self.activity_ids,
            &self.sku_ids,
            &self.user_ids,
            &self.reject_reasons,
            &self.reserved_at,
            &self.valid_until,
        ]
    }
}

/// `orders`: the orders to insert (price from the SKU, payment deadline from the batch).
#[derive(Default)]
pub(super) struct OrderRows {
    pub(super) order_ids: Vec<String>,
    pub(super) reservation_ids: Vec<String>,
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) user_ids: Vec<i64>,
    pub(super) reserved_at: Vec<DateTime<Utc>>,
    /// The stock bucket the reservation was taken in (its home: where its unit is looked for).
    pub(super) buckets: Vec<i16>,
    /// The buyer's sales channel (v2 messages; `None` from v1).
    pub(super) channels: Vec<Option<String>>,
}

impl OrderRows {
    pub(super) fn push(&mut self, e: &OrderCreateRequested) {
        self.order_ids.push(e.order_id.clone());
        self.reservation_ids.push(e.reservation_id.clone());
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
        self.reserved_at.push(e.reservation_created_at);
        self.buckets.push(home_bucket(e));
        self.channels.push(e.channel.clone());
    }

    pub(super) fn params<'p>(
        &'p self,
        expires_at: &'p DateTime<Utc>,
    ) -> [&'p (dyn ToSql + Sync); 9] {
        [
            &self.order_ids,
            &self.reservation_ids,
            &self.activity_ids,
            &self.sku_ids,
            &self.user_ids,
            expires_at,
            &self.reserved_at,
            &self.buckets,
            &self.channels,
        ]
    }
}

/// The stock bucket an order's unit is taken from first: the one its reservation id names
/// (docs/ARCHITECTURE.md#stock-buckets).
pub(super) fn home_bucket(e: &OrderCreateRequested) -> i16 {
    crate::domain::ids::reservation_bucket(&e.reservation_id) as i16
}

/// `stock_ledger`: one debit per created order.
#[derive(Default)]
pub(super) struct LedgerRows {
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) order_ids: Vec<String>,
    /// The bucket row the unit came from.
    pub(super) buckets: Vec<i16>,
}

impl LedgerRows {
    pub(super) fn push(&mut self, e: &OrderCreateRequested, bucket: i16) {
        self.order_ids.push(e.order_id.clone());
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.buckets.push(bucket);
    }
}

/// `event_outbox`: the events of the batch, in the order they are relayed.
#[derive(Default)]
pub(super) struct OutboxRows {
    pub(super) event_ids: Vec<String>,
    pub(super) topics: Vec<String>,
    pub(super) tags: Vec<String>,
    pub(super) keys: Vec<String>,
    pub(super) aggregate_ids: Vec<Option<String>>,
    pub(super) versions: Vec<Option<i32>>,
    pub(super) payloads: Vec<serde_json::Value>,
    pub(super) deliver_at: Vec<Option<DateTime<Utc>>>,
    /// When the relay first sends the row (`None`: at once, the database's `now()`).
    pub(super) first_send_at: Vec<Option<DateTime<Utc>>>,
}

impl OutboxRows {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        event_id: String,
        topic: &str,
        tag: &str,
        key: &str,
        aggregate: Option<(&str, Option<i32>)>,
        payload: serde_json::Value,
        deliver_at: Option<DateTime<Utc>>,
        first_send_at: Option<DateTime<Utc>>,
    ) {
        self.event_ids.push(event_id);
        self.topics.push(topic.to_string());
        self.tags.push(tag.to_string());
        self.keys.push(key.to_string());
        self.aggregate_ids
            .push(aggregate.map(|(id, _)| id.to_string()));
        self.versions.push(aggregate.and_then(|(_, v)| v));
        self.payloads.push(payload);
        self.deliver_at.push(deliver_at);
        self.first_send_at.push(first_send_at);
    }

    /// A created order's ORDER_CREATED and its CANCEL_ORDER_IF_UNPAID timer (at `expires_at`).
    pub(super) fn push_created(&mut self, b: &Batch<'_>, e: &OrderCreateRequested) {
        let facts = order_facts(e);
        let mut created = OrderCreated::new(&facts, b.expires_at);
        created.base.occurred_at = Some(b.now);
        created.traceparent = Some(e.trace.traceparent.clone());
        self.push(
            created.base.event_id.clone(),
            &b.names.order_event_topic,
            TAG_ORDER_CREATED,
            &e.order_id,
            Some((&e.order_id, Some(1))),
            payload(&created),
            None,
            None,
        );
        let mut cancel = CancelOrderIfUnpaid::new(
            cancel_if_unpaid_event_id(&e.order_id),
            &e.order_id,
            e.activity_id,
            e.sku_id,
            b.expires_at,
        );
        cancel.traceparent = Some(e.trace.traceparent.clone());
        self.push(
            cancel.event_id.clone(),
            &b.names.order_timeout_topic,
            TAG_CANCEL_IF_UNPAID,
            &e.order_id,
            Some((&e.order_id, None)),
            payload(&cancel),
            Some(b.expires_at),
            // Held in the outbox until shortly before it is due (docs/ARCHITECTURE.md#outbox-relay).
            Some(b.expires_at - b.names.timer_lead),
        );
    }

    /// A rejected reservation's RELEASE_RESERVATION (the compensation path).
    pub(super) fn push_release(
        &mut self,
        b: &Batch<'_>,
        e: &OrderCreateRequested,
        reason: RejectReason,
    ) {
        let mut release = ReleaseReservation::new(&order_facts(e), reason.code());
        release.message_id = Some(e.message_id.clone());
        release.occurred_at = Some(b.now);
        release.traceparent = Some(e.trace.traceparent.clone());
        self.push(
            release.event_id.clone(),
            &b.names.compensate_topic,
            TAG_RELEASE_RESERVATION,
            &e.reservation_id,
            None,
            payload(&release),
            None,
            None,
        );
    }

    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        [
            &self.event_ids,
            &self.topics,
            &self.tags,
            &self.keys,
            &self.aggregate_ids,
            &self.versions,
            &self.payloads,
            &self.deliver_at,
            &self.first_send_at,
        ]
    }
}

fn order_facts(e: &OrderCreateRequested) -> OrderRef {
    OrderRef {
        order_id: e.order_id.clone(),
        reservation_id: e.reservation_id.clone(),
        activity_id: e.activity_id,
        sku_id: e.sku_id,
        user_id: e.user_id,
    }
}

/// `reservations` marked REJECTED and their `compensation_tasks`.
#[derive(Default)]
pub(super) struct RejectionRows {
    pub(super) reservation_ids: Vec<String>,
    pub(super) reasons: Vec<String>,
    pub(super) task_ids: Vec<String>,
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) user_ids: Vec<i64>,
}

impl RejectionRows {
    pub(super) fn push(&mut self, e: &OrderCreateRequested, reason: RejectReason) {
        self.reservation_ids.push(e.reservation_id.clone());
        self.reasons.push(reason.code().to_string());
        self.task_ids.push(compensation_task_id(&e.reservation_id));
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
    }

    pub(super) fn task_params(&self) -> [&(dyn ToSql + Sync); 6] {
        [
            &self.task_ids,
            &self.reservation_ids,
            &self.activity_ids,
            &self.sku_ids,
            &self.user_ids,
            &self.reasons,
        ]
    }
}

/// `consumer_inbox`: the outcome of every message this batch owns.
pub(super) struct InboxOutcomes {
    pub(super) message_ids: Vec<String>,
    pub(super) statuses: Vec<&'static str>,
    pub(super) decisions: Vec<String>,
}

impl InboxOutcomes {
    pub(super) fn of(b: &Batch<'_>, owned: &[usize], rejected: &[(usize, RejectReason)]) -> Self {
        let rejected: HashMap<usize, RejectReason> = rejected.iter().copied().collect();
        let mut out = Self {
            message_ids: Vec::with_capacity(owned.len()),
            statuses: Vec::with_capacity(owned.len()),
            decisions: Vec::with_capacity(owned.len()),
        };
        for &i in owned {
            let (status, decision) = if let Some(r) = rejected.get(&i) {
                ("REJECTED", r.code().to_string())
            } else if b.decisions[i] == Some(Decision::DuplicateReservation) {
                ("SUCCEEDED", "DUPLICATE_RESERVATION".to_string())
            } else {
                ("SUCCEEDED", "CREATED".to_string())
            };
            out.message_ids.push(b.ev(i).message_id.clone());
            out.statuses.push(status);
            out.decisions.push(decision);
        }
        out
    }
}
