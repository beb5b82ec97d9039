//! The column arrays of the order transaction's own set-based (`unnest`) statements, one
//! struct per statement, each filled from the batch's events; the ledger, compensation and
//! outbox rows it shares with the other writers are `pg::rows`.

use crate::domain::status::InboxStatus;
use std::collections::HashMap;

use chrono::{DateTime, Utc};
use tokio_postgres::types::ToSql;

use super::Batch;
use crate::domain::events::{OrderRef, ReleaseReservation};
use crate::domain::{Decision, OrderCreateRequested, RejectReason};
use crate::pg::rows::{CompensationRows, InboxOutcomes, OutboxEvent, OutboxRows};

/// `reservations`: the decision row of each reservation (`ORDERED`, or `REJECTED` with why).
/// The ids are borrowed from the batch's events: nothing is copied to bind them.
#[derive(Default)]
pub(super) struct ReservationRows<'a> {
    pub(super) reservation_ids: Vec<&'a str>,
    pub(super) message_ids: Vec<&'a str>,
    pub(super) request_ids: Vec<&'a str>,
    pub(super) order_ids: Vec<&'a str>,
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) user_ids: Vec<i64>,
    pub(super) reject_reasons: Vec<Option<&'static str>>,
    pub(super) reserved_at: Vec<DateTime<Utc>>,
    pub(super) valid_until: Vec<DateTime<Utc>>,
}

impl<'a> ReservationRows<'a> {
    pub(super) fn push(&mut self, e: &'a OrderCreateRequested, early: Option<RejectReason>) {
        self.reservation_ids.push(&e.reservation_id);
        self.message_ids.push(&e.message_id);
        self.request_ids.push(&e.request_id);
        self.order_ids.push(&e.order_id);
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
        self.reject_reasons.push(early.map(|r| r.code()));
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

/// `orders`: the orders to insert (price from the SKU, payment deadline from the batch), the
/// ids borrowed from the batch's events.
#[derive(Default)]
pub(super) struct OrderRows<'a> {
    pub(super) order_ids: Vec<&'a str>,
    pub(super) reservation_ids: Vec<&'a str>,
    pub(super) activity_ids: Vec<i64>,
    pub(super) sku_ids: Vec<i64>,
    pub(super) user_ids: Vec<i64>,
    pub(super) reserved_at: Vec<DateTime<Utc>>,
    /// The stock bucket the reservation was taken in (its home: where its unit is looked for).
    pub(super) buckets: Vec<i16>,
    /// The buyer's sales channel (v2 messages; `None` from v1).
    pub(super) channels: Vec<Option<&'a str>>,
}

impl<'a> OrderRows<'a> {
    pub(super) fn push(&mut self, e: &'a OrderCreateRequested) {
        self.order_ids.push(&e.order_id);
        self.reservation_ids.push(&e.reservation_id);
        self.activity_ids.push(e.activity_id);
        self.sku_ids.push(e.sku_id);
        self.user_ids.push(e.user_id);
        self.reserved_at.push(e.reservation_created_at);
        self.buckets.push(home_bucket(e));
        self.channels.push(e.channel.as_deref());
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
/// (docs/architecture/redis.md#stock-buckets).
pub(super) fn home_bucket(e: &OrderCreateRequested) -> i16 {
    crate::domain::ids::reservation_bucket(&e.reservation_id) as i16
}

/// A rejected reservation's RELEASE_RESERVATION (the compensation path).
pub(super) fn push_release<'a>(
    out: &mut OutboxRows<'a>,
    b: &Batch<'a>,
    e: &'a OrderCreateRequested,
    reason: RejectReason,
) {
    let mut release = ReleaseReservation::new(&order_facts(e), reason.code());
    release.message_id = Some(e.message_id.clone());
    release.occurred_at = Some(b.now);
    release.traceparent = Some(e.trace.traceparent.clone());
    let topic = &b.names.compensate_topic;
    out.push(OutboxEvent::release(&release, topic, &e.reservation_id));
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

/// `reservations` marked REJECTED, with their `compensation_tasks`.
#[derive(Default)]
pub(super) struct RejectionRows {
    pub(super) reservation_ids: Vec<String>,
    pub(super) reasons: Vec<String>,
    pub(super) tasks: CompensationRows,
}

/// One statement: the rows found with `reservation_id = ANY($1)` (an index scan even on a table
/// without statistics, where a join with `unnest` was planned as a hash join over the whole
/// table), each one's reason taken from the same position of `$2`.
pub(super) const MARK_REJECTED: &str = "UPDATE reservations
        SET status = 'REJECTED', reject_reason = ($2::text[])[array_position($1::text[], reservation_id)]
      WHERE reservation_id = ANY($1::text[])";

impl RejectionRows {
    pub(super) fn push(&mut self, e: &OrderCreateRequested, reason: RejectReason) {
        self.reservation_ids.push(e.reservation_id.clone());
        self.reasons.push(reason.code().to_string());
        self.tasks.push(
            &e.reservation_id,
            e.activity_id,
            e.sku_id,
            e.user_id,
            reason.code(),
        );
    }
}

/// The owned messages whose inbox row must change: what each came to, where that is not the
/// outcome its claim wrote ([`Batch::expected_outcome`]). Empty when every order was created.
pub(super) fn inbox_corrections(
    b: &Batch<'_>,
    owned: &[usize],
    rejected: &[(usize, RejectReason)],
) -> InboxOutcomes {
    let rejected: HashMap<usize, RejectReason> = rejected.iter().copied().collect();
    let mut out = InboxOutcomes::default();
    for &i in owned {
        let (status, decision) = if let Some(r) = rejected.get(&i) {
            (InboxStatus::Rejected.as_str(), r.code())
        } else if b.decisions[i] == Some(Decision::DuplicateReservation) {
            (InboxStatus::Succeeded.as_str(), "DUPLICATE_RESERVATION")
        } else {
            (InboxStatus::Succeeded.as_str(), "CREATED")
        };
        if (status, decision) != b.expected_outcome(i) {
            out.push(b.ev(i).message_id.clone(), status, decision.to_string());
        }
    }
    out
}
