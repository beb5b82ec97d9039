//! The decisions the pipeline takes about a message or an order, free of I/O: what an
//! ORDER_CREATE_REQUESTED came to, why a reservation was rejected, what a cancel or a payment
//! came to. Each has a stable label for metrics and logs.

use chrono::{DateTime, Utc};

/// Why a reservation did not become an order. Each one is recorded and compensated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// `reservation_valid_until` passed before the consumer got to it.
    Expired,
    /// PostgreSQL final stock is exhausted.
    NoStock,
    /// The buyer already has a valid order for this activity SKU.
    DuplicateBuyer,
    /// The activity SKU does not exist in PostgreSQL.
    UnknownSku,
    /// Withdrawn before any copy of its message reached the consumer: an operator discarded
    /// its dead letter, or a re-send the broker refused after the reservation's validity was
    /// settled from PostgreSQL (docs/architecture/hot-path.md#uncertain-sends).
    Withdrawn,
    /// Still valid, but with less of its validity left than an order would take while the
    /// consumer is behind: rejected ahead of the queue by the fast lane
    /// (`consumer.fast_lane_backlog_ms`, docs/architecture/roles.md#the-fast-lane).
    Expiring,
}

impl RejectReason {
    pub fn code(&self) -> &'static str {
        match self {
            RejectReason::Expired => "EXPIRED",
            RejectReason::NoStock => "NO_STOCK",
            RejectReason::DuplicateBuyer => "DUPLICATE_BUYER",
            RejectReason::UnknownSku => "UNKNOWN_SKU",
            RejectReason::Withdrawn => "WITHDRAWN",
            RejectReason::Expiring => "EXPIRING",
        }
    }
}

/// What one message came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Created {
        order_id: String,
    },
    /// Its message_id was already processed by this group (inbox hit).
    DuplicateMessage,
    /// Another message already decided this reservation.
    DuplicateReservation,
    Rejected(RejectReason),
    Quarantined(&'static str),
}

impl Decision {
    /// Stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Decision::Created { .. } => "created",
            Decision::DuplicateMessage => "duplicate_message",
            Decision::DuplicateReservation => "duplicate_reservation",
            Decision::Rejected(_) => "rejected",
            Decision::Quarantined(_) => "quarantined",
        }
    }
}

/// What a cancel message came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The order was unpaid and expired: cancelled, its unit returned.
    Canceled {
        version: i32,
    },
    /// Paid before the deadline: nothing to do (counted).
    AlreadyPaid,
    AlreadyCanceled,
    /// This cancel message was already processed by the group (inbox hit).
    Duplicate,
    /// Delivered before `expires_at`: retry later, never drop.
    NotYetExpired {
        expires_at: DateTime<Utc>,
    },
    NotFound,
}

impl CancelOutcome {
    pub fn label(&self) -> &'static str {
        match self {
            CancelOutcome::Canceled { .. } => "canceled",
            CancelOutcome::AlreadyPaid => "noop_paid",
            CancelOutcome::AlreadyCanceled => "noop_canceled",
            CancelOutcome::Duplicate => "duplicate",
            CancelOutcome::NotYetExpired { .. } => "early",
            CancelOutcome::NotFound => "not_found",
        }
    }
}

/// What a payment attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PayOutcome {
    Paid {
        version: i32,
    },
    /// Already paid with this payment_id: the same answer again.
    AlreadyPaidSame,
    /// Paid with another payment: this one is owed back.
    AlreadyPaidOther,
    /// The notification's amount is not the order's: the order is unchanged, the payment is
    /// owed back.
    AmountMismatch {
        expected_cents: i64,
    },
    /// This payment id already settled (or is owed back for) another order: nothing written.
    PaymentIdReused,
    /// Cancelled before the payment: owed back.
    Canceled,
    /// Past its payment window (the cancel not yet run): owed back.
    Expired,
    NotFound,
}

impl PayOutcome {
    /// The refund obligation's reason when the provider took the buyer's money and this
    /// outcome leaves it with no order (docs/architecture/recovery.md#refund-obligations); `None`
    /// when the payment settled its order, settled another (a reused id), or names no order.
    pub fn refund_reason(&self) -> Option<&'static str> {
        match self {
            PayOutcome::Canceled => Some("ORDER_CANCELED"),
            PayOutcome::Expired => Some("ORDER_EXPIRED"),
            PayOutcome::AlreadyPaidOther => Some("ALREADY_PAID"),
            PayOutcome::AmountMismatch { .. } => Some("AMOUNT_MISMATCH"),
            PayOutcome::Paid { .. }
            | PayOutcome::AlreadyPaidSame
            | PayOutcome::PaymentIdReused
            | PayOutcome::NotFound => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_payment_that_took_money_for_no_order_is_owed_back() {
        let owed = [
            (PayOutcome::Canceled, "ORDER_CANCELED"),
            (PayOutcome::Expired, "ORDER_EXPIRED"),
            (PayOutcome::AlreadyPaidOther, "ALREADY_PAID"),
            (
                PayOutcome::AmountMismatch {
                    expected_cents: 100,
                },
                "AMOUNT_MISMATCH",
            ),
        ];
        for (outcome, reason) in owed {
            assert_eq!(outcome.refund_reason(), Some(reason), "{outcome:?}");
        }
        // Settled here (now or before), settled elsewhere, or no order at all.
        for outcome in [
            PayOutcome::Paid { version: 2 },
            PayOutcome::AlreadyPaidSame,
            PayOutcome::PaymentIdReused,
            PayOutcome::NotFound,
        ] {
            assert_eq!(outcome.refund_reason(), None, "{outcome:?}");
        }
    }
}
