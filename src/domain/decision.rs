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
    /// settled from PostgreSQL (docs/ARCHITECTURE.md#uncertain-sends).
    Withdrawn,
}

impl RejectReason {
    pub fn code(&self) -> &'static str {
        match self {
            RejectReason::Expired => "EXPIRED",
            RejectReason::NoStock => "NO_STOCK",
            RejectReason::DuplicateBuyer => "DUPLICATE_BUYER",
            RejectReason::UnknownSku => "UNKNOWN_SKU",
            RejectReason::Withdrawn => "WITHDRAWN",
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
    AlreadyPaidOther,
    /// The notification's amount is not the order's: nothing written.
    AmountMismatch {
        expected_cents: i64,
    },
    /// This payment id already settled another order: nothing written.
    PaymentIdReused,
    Canceled,
    Expired,
    NotFound,
}
