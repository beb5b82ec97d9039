//! The reservation hash as `lua/reserve.lua` writes it (one per reservation, under the
//! activity's hash tag): the fields the scanner reads back to re-send a reservation. The other
//! scripts change only `status`, `mq_status`, `send_attempt`, `next_retry_at` and the lease.

use std::collections::HashMap;

use chrono::{DateTime, TimeZone, Utc};

use crate::domain::order_create::ReservationRef;

/// The fields of one reservation hash that describe the reservation itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationHash {
    pub reservation_id: String,
    pub message_id: String,
    pub order_id: String,
    pub request_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
    /// `RESERVED` or `RELEASED`.
    pub status: String,
    /// `MQ_PENDING`, `MQ_SENT`, `MQ_FAILED` or `MQ_FENCED` (settled from PostgreSQL: no copy
    /// was consumed, none ever will be).
    pub mq_status: String,
    /// Sends so far, the API's first one included (1 when the field is absent).
    pub send_attempt: i64,
    pub created_at: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
    /// W3C traceparent of the buyer's request ("" when there was none).
    pub traceparent: String,
    /// The buyer's sales channel (absent when the request named none, and in hashes an
    /// earlier release wrote).
    pub channel: Option<String>,
}

impl ReservationHash {
    /// The reservation's ids, as its messages carry them.
    pub fn reservation(&self) -> ReservationRef<'_> {
        ReservationRef {
            message_id: &self.message_id,
            request_id: &self.request_id,
            reservation_id: &self.reservation_id,
            order_id: &self.order_id,
            activity_id: self.activity_id,
            sku_id: self.sku_id,
            user_id: self.user_id,
        }
    }

    /// Parses a hash as `HGETALL` returns it; `None` when a field that identifies the
    /// reservation is missing or malformed.
    pub fn parse(f: &HashMap<String, String>) -> Option<Self> {
        let s = |k: &str| f.get(k).cloned();
        let n = |k: &str| f.get(k).and_then(|v| v.parse::<i64>().ok());
        let ms = |k: &str| n(k).and_then(|v| Utc.timestamp_millis_opt(v).single());
        Some(Self {
            reservation_id: s("reservation_id")?,
            message_id: s("message_id")?,
            order_id: s("order_id")?,
            request_id: s("request_id")?,
            activity_id: n("activity_id")?,
            sku_id: n("sku_id")?,
            user_id: n("user_id")?,
            status: s("status").unwrap_or_default(),
            mq_status: s("mq_status").unwrap_or_default(),
            send_attempt: n("send_attempt").unwrap_or(1),
            created_at: ms("created_at")?,
            valid_until: ms("valid_until")?,
            traceparent: s("traceparent").unwrap_or_default(),
            channel: s("channel").filter(|c| crate::domain::order_create::is_valid_channel(c)),
        })
    }
}
