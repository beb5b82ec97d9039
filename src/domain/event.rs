//! `ORDER_CREATE_REQUESTED`, schema v1 (docs/ARCHITECTURE.md#the-order-create-message): the
//! message between the API (or the re-send scanner) and the order consumer.
//! `reservation_valid_until` is immutable and is the consumer's business deadline.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::ids::{is_valid_id, reservation_activity};

pub const SCHEMA_VERSION: i32 = 1;
pub const EVENT_ORDER_CREATE_REQUESTED: &str = "ORDER_CREATE_REQUESTED";
/// Tag of order-create messages (a small, stable category, never an id).
pub const TAG_CREATE_ORDER: &str = "CREATE_ORDER";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TraceContext {
    pub trace_id: String,
    pub span_id: String,
    pub traceparent: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCreateRequested {
    pub schema_version: i32,
    pub event_type: String,
    pub message_id: String,
    pub message_key: String,
    pub request_id: String,
    pub reservation_id: String,
    pub order_id: String,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
    pub quantity: i32,
    pub reservation_created_at: DateTime<Utc>,
    pub reservation_valid_until: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    /// Application-level re-sends (scanner), not broker redeliveries.
    pub retry_count: i32,
    /// Operator replays.
    pub replay_count: i32,
    pub producer: String,
    #[serde(default)]
    pub trace: TraceContext,
}

/// Why a message body cannot be processed, ever. Such messages are quarantined, not retried.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum PoisonReason {
    #[error("INVALID_JSON: {0}")]
    InvalidJson(String),
    #[error("UNSUPPORTED_SCHEMA: schema_version {0}")]
    UnsupportedSchema(i64),
    #[error("INVALID_EVENT: {0}")]
    InvalidEvent(String),
}

impl PoisonReason {
    /// Stable code stored in the quarantine row and used as a metric label.
    pub fn code(&self) -> &'static str {
        match self {
            PoisonReason::InvalidJson(_) => "INVALID_JSON",
            PoisonReason::UnsupportedSchema(_) => "UNSUPPORTED_SCHEMA",
            PoisonReason::InvalidEvent(_) => "INVALID_EVENT",
        }
    }
}

/// Which reservation, whose and of what: the ids the API mints before touching Redis, the
/// buyer's request id and the activity SKU. The reserve script stores them and every message
/// about the reservation carries them unchanged.
#[derive(Debug, Clone, Copy)]
pub struct ReservationRef<'a> {
    pub message_id: &'a str,
    pub request_id: &'a str,
    pub reservation_id: &'a str,
    pub order_id: &'a str,
    pub activity_id: i64,
    pub sku_id: i64,
    pub user_id: i64,
}

/// A reservation as its ORDER_CREATE_REQUESTED describes it: its ids and the validity the
/// reserve script fixed. The API's first send and every re-send of the scanner build the
/// event from this, so both carry the same ids.
#[derive(Debug, Clone)]
pub struct ReservationFacts<'a> {
    pub reservation: ReservationRef<'a>,
    pub quantity: i32,
    pub created_at: DateTime<Utc>,
    pub valid_until: DateTime<Utc>,
}

impl OrderCreateRequested {
    /// The event of a reservation; `retry_count` counts the scanner's re-sends (0 on the
    /// API's first send), `producer` names the role that sends it.
    pub fn new(
        facts: &ReservationFacts<'_>,
        producer: &str,
        retry_count: i32,
        trace: TraceContext,
    ) -> Self {
        let r = &facts.reservation;
        Self {
            schema_version: SCHEMA_VERSION,
            event_type: EVENT_ORDER_CREATE_REQUESTED.to_string(),
            message_id: r.message_id.to_owned(),
            message_key: r.reservation_id.to_owned(),
            request_id: r.request_id.to_owned(),
            reservation_id: r.reservation_id.to_owned(),
            order_id: r.order_id.to_owned(),
            activity_id: r.activity_id,
            sku_id: r.sku_id,
            user_id: r.user_id,
            quantity: facts.quantity,
            reservation_created_at: facts.created_at,
            reservation_valid_until: facts.valid_until,
            created_at: Utc::now(),
            retry_count,
            replay_count: 0,
            producer: producer.to_string(),
            trace,
        }
    }

    /// Decodes and validates a message body. The schema version is checked before the shape,
    /// so a future v2 message is reported as unsupported rather than malformed.
    pub fn decode(body: &[u8]) -> Result<Self, PoisonReason> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| PoisonReason::InvalidJson(e.to_string()))?;
        match value.get("schema_version").and_then(|v| v.as_i64()) {
            Some(v) if v == i64::from(SCHEMA_VERSION) => {}
            Some(v) => return Err(PoisonReason::UnsupportedSchema(v)),
            None => {
                return Err(PoisonReason::InvalidEvent(
                    "schema_version is missing".to_string(),
                ))
            }
        }
        let event: OrderCreateRequested =
            serde_json::from_value(value).map_err(|e| PoisonReason::InvalidEvent(e.to_string()))?;
        event.validate().map_err(PoisonReason::InvalidEvent)?;
        Ok(event)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.event_type != EVENT_ORDER_CREATE_REQUESTED {
            return Err(format!("unexpected event_type {}", self.event_type));
        }
        if !is_valid_id("evt", &self.message_id) {
            return Err("message_id is not an evt_ id".into());
        }
        if !is_valid_id("rsv", &self.reservation_id) {
            return Err("reservation_id is not an rsv_ id".into());
        }
        if reservation_activity(&self.reservation_id).is_some_and(|a| a != self.activity_id) {
            return Err("reservation_id names another activity".into());
        }
        if !is_valid_id("ord", &self.order_id) {
            return Err("order_id is not an ord_ id".into());
        }
        if self.request_id.is_empty() || self.request_id.len() > 64 {
            return Err("request_id must be 1-64 characters".into());
        }
        if self.activity_id <= 0 || self.sku_id <= 0 || self.user_id <= 0 {
            return Err("activity_id, sku_id and user_id must be positive".into());
        }
        if self.quantity != 1 {
            return Err("quantity must be 1".into());
        }
        if self.reservation_valid_until <= self.reservation_created_at {
            return Err("reservation_valid_until must be after reservation_created_at".into());
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        // Serialising a struct of plain fields cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::domain::Ids;

    pub fn sample() -> OrderCreateRequested {
        let ids = Ids::generate(10001, 0);
        let now = Utc::now();
        OrderCreateRequested {
            schema_version: 1,
            event_type: EVENT_ORDER_CREATE_REQUESTED.into(),
            message_key: ids.reservation_id.clone(),
            message_id: ids.message_id,
            request_id: "req-1".into(),
            reservation_id: ids.reservation_id,
            order_id: ids.order_id,
            activity_id: 10001,
            sku_id: 20001,
            user_id: 90000001,
            quantity: 1,
            reservation_created_at: now,
            reservation_valid_until: now + chrono::Duration::seconds(300),
            created_at: now,
            retry_count: 0,
            replay_count: 0,
            producer: "seckill-api".into(),
            trace: TraceContext::default(),
        }
    }

    #[test]
    fn round_trips() {
        let e = sample();
        assert_eq!(OrderCreateRequested::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn classifies_poison() {
        assert_eq!(
            OrderCreateRequested::decode(b"{oops").unwrap_err().code(),
            "INVALID_JSON"
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v["schema_version"] = 2.into();
        assert_eq!(
            OrderCreateRequested::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err(),
            PoisonReason::UnsupportedSchema(2)
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v.as_object_mut().unwrap().remove("order_id");
        assert_eq!(
            OrderCreateRequested::decode(&serde_json::to_vec(&v).unwrap())
                .unwrap_err()
                .code(),
            "INVALID_EVENT"
        );
        let mut e = sample();
        e.quantity = 3;
        assert_eq!(
            OrderCreateRequested::decode(&e.encode())
                .unwrap_err()
                .code(),
            "INVALID_EVENT"
        );
        // A reservation id naming one activity on an event for another.
        let mut e = sample();
        e.activity_id += 1;
        assert_eq!(
            OrderCreateRequested::decode(&e.encode()).unwrap_err(),
            PoisonReason::InvalidEvent("reservation_id names another activity".into())
        );
    }
}
