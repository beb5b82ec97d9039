//! `ORDER_CREATE_REQUESTED` (docs/architecture/messages.md#the-order-create-message): the message
//! between the API (or the re-send scanner) and the order consumer. `reservation_valid_until` is
//! immutable and is the consumer's business deadline.
//!
//! Two schema versions are read (docs/architecture/postgresql.md#upgrades): v1, and v2 = v1 plus
//! the buyer's sales `channel`. Producers write the version `mq.order_event_schema` names, so a
//! rollout upgrades every consumer before any producer writes v2.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::ids::{is_valid_id, reservation_activity};

/// Schema version of the events PostgreSQL originates, and the first of ORDER_CREATE_REQUESTED.
pub const SCHEMA_VERSION: i32 = 1;
/// ORDER_CREATE_REQUESTED v2: v1 plus `channel`.
pub const SCHEMA_V2: i32 = 2;

/// The first byte of a JSON object (`{`).
const JSON_OBJECT_START: u8 = 0x7b;
/// Longest sales channel name.
pub const MAX_CHANNEL_LEN: usize = 32;

/// A sales channel name (`app`, `web`, `mini_program`, ...): 1-32 of `a-z 0-9 _ -`.
pub fn is_valid_channel(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_CHANNEL_LEN
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}
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
    #[serde(deserialize_with = "super::rfc3339::deserialize")]
    pub reservation_created_at: DateTime<Utc>,
    #[serde(deserialize_with = "super::rfc3339::deserialize")]
    pub reservation_valid_until: DateTime<Utc>,
    #[serde(deserialize_with = "super::rfc3339::deserialize")]
    pub created_at: DateTime<Utc>,
    /// Application-level re-sends (scanner), not broker redeliveries.
    pub retry_count: i32,
    /// Operator replays.
    pub replay_count: i32,
    pub producer: String,
    #[serde(default)]
    pub trace: TraceContext,
    /// v2: the sales channel the buyer reserved through (absent in v1, optional in v2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<String>,
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
    /// The buyer's sales channel, if the request named one (carried from v2 on).
    pub channel: Option<&'a str>,
}

impl OrderCreateRequested {
    /// The event of a reservation in schema `schema` (1 or 2: v1 leaves the channel out);
    /// `retry_count` counts the scanner's re-sends (0 on the API's first send), `producer`
    /// names the role that sends it.
    pub fn new(
        facts: &ReservationFacts<'_>,
        schema: i32,
        producer: &str,
        retry_count: i32,
        trace: TraceContext,
    ) -> Self {
        let r = &facts.reservation;
        let v2 = schema >= SCHEMA_V2;
        Self {
            schema_version: if v2 { SCHEMA_V2 } else { SCHEMA_VERSION },
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
            channel: facts.channel.filter(|_| v2).map(str::to_owned),
        }
    }

    /// Decodes and validates a message body (v1 or v2). The schema version is checked before
    /// the shape, so a future v3 message is reported as unsupported rather than malformed.
    pub fn decode(body: &[u8]) -> Result<Self, PoisonReason> {
        // The common case in one typed pass, without building the document: an object that
        // reads as the event with a version this build knows. Anything else takes the
        // reference path below, which classifies it.
        if body.trim_ascii_start().first() == Some(&JSON_OBJECT_START) {
            if let Ok(event) = serde_json::from_slice::<OrderCreateRequested>(body) {
                if (SCHEMA_VERSION..=SCHEMA_V2).contains(&event.schema_version) {
                    return event.checked();
                }
            }
        }
        Self::decode_reference(body)
    }

    /// A decoded event of a known version, as the consumer keeps it: v1 has no channel (a
    /// stray one is not part of the message), and its fields must be valid.
    fn checked(mut self) -> Result<Self, PoisonReason> {
        if self.schema_version == SCHEMA_VERSION {
            self.channel = None;
        }
        self.validate().map_err(PoisonReason::InvalidEvent)?;
        Ok(self)
    }

    /// [`Self::decode`] through a `serde_json::Value`: the version read before the shape, so
    /// a future v3 message is reported as unsupported rather than malformed.
    fn decode_reference(body: &[u8]) -> Result<Self, PoisonReason> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| PoisonReason::InvalidJson(e.to_string()))?;
        match value.get("schema_version").and_then(|v| v.as_i64()) {
            Some(v) if (i64::from(SCHEMA_VERSION)..=i64::from(SCHEMA_V2)).contains(&v) => {}
            Some(v) => return Err(PoisonReason::UnsupportedSchema(v)),
            None => {
                return Err(PoisonReason::InvalidEvent(
                    "schema_version is missing".to_string(),
                ))
            }
        }
        let event: OrderCreateRequested =
            serde_json::from_value(value).map_err(|e| PoisonReason::InvalidEvent(e.to_string()))?;
        event.checked()
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
        if self
            .channel
            .as_deref()
            .is_some_and(|c| !is_valid_channel(c))
        {
            return Err("channel must be 1-32 characters of a-z 0-9 _ -".into());
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
            channel: None,
        }
    }

    #[test]
    fn the_typed_pass_decides_as_the_reference_path_does() {
        let e = sample();
        let mut v1_with_channel: serde_json::Value = serde_json::from_slice(&e.encode()).unwrap();
        v1_with_channel["channel"] = "app".into();
        let mut v2 = v1_with_channel.clone();
        v2["schema_version"] = 2.into();
        let mut v3 = v2.clone();
        v3["schema_version"] = 3.into();
        let mut bad_id = v2.clone();
        bad_id["reservation_id"] = "rsv_x".into();
        let fields: Vec<serde_json::Value> = match serde_json::to_value(&e).unwrap() {
            serde_json::Value::Object(m) => m.into_iter().map(|(_, v)| v).collect(),
            _ => unreachable!(),
        };
        let encoded = String::from_utf8(e.encode()).unwrap();
        let bodies: Vec<Vec<u8>> = vec![
            e.encode(),
            format!("  \n{encoded}").into_bytes(),
            serde_json::to_vec(&v1_with_channel).unwrap(),
            serde_json::to_vec(&v2).unwrap(),
            serde_json::to_vec(&v3).unwrap(),
            serde_json::to_vec(&bad_id).unwrap(),
            // The fields as an array: serde would read a struct from it; not an event.
            serde_json::to_vec(&fields).unwrap(),
            // A duplicate key: the document keeps the last one.
            encoded
                .replacen("{", "{\"schema_version\":9,", 1)
                .into_bytes(),
            b"{\"schema_version\":1}".to_vec(),
            b"not json".to_vec(),
        ];
        for body in bodies {
            assert_eq!(
                OrderCreateRequested::decode(&body),
                OrderCreateRequested::decode_reference(&body),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
        assert!(OrderCreateRequested::decode(&serde_json::to_vec(&v2).unwrap()).is_ok());
    }

    #[test]
    fn round_trips() {
        let e = sample();
        assert_eq!(OrderCreateRequested::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn reads_v1_and_v2() {
        let ids = Ids::generate(10001, 0);
        let now = Utc::now();
        let facts = ReservationFacts {
            reservation: ReservationRef {
                message_id: &ids.message_id,
                request_id: "req-1",
                reservation_id: &ids.reservation_id,
                order_id: &ids.order_id,
                activity_id: 10001,
                sku_id: 20001,
                user_id: 7,
            },
            quantity: 1,
            created_at: now,
            valid_until: now + chrono::Duration::seconds(60),
            channel: Some("app"),
        };
        let trace = TraceContext::default();
        // v1: byte-compatible with what a v1-only consumer reads: no channel key at all.
        let v1 = OrderCreateRequested::new(&facts, 1, "seckill-api", 0, trace.clone());
        let body: serde_json::Value = serde_json::from_slice(&v1.encode()).unwrap();
        assert_eq!(body["schema_version"], 1);
        assert!(body.get("channel").is_none());
        assert_eq!(OrderCreateRequested::decode(&v1.encode()).unwrap(), v1);
        // v2 carries the channel.
        let v2 = OrderCreateRequested::new(&facts, 2, "seckill-api", 0, trace.clone());
        assert_eq!(v2.schema_version, 2);
        let back = OrderCreateRequested::decode(&v2.encode()).unwrap();
        assert_eq!(back.channel.as_deref(), Some("app"));
        // v2 without a channel is valid; a v1 body with a stray channel ignores it.
        let none = ReservationFacts {
            channel: None,
            ..facts.clone()
        };
        let v2 = OrderCreateRequested::new(&none, 2, "seckill-api", 0, trace);
        assert_eq!(
            OrderCreateRequested::decode(&v2.encode()).unwrap().channel,
            None
        );
        let mut v = serde_json::to_value(&v1).unwrap();
        v["channel"] = "web".into();
        let decoded = OrderCreateRequested::decode(&serde_json::to_vec(&v).unwrap()).unwrap();
        assert_eq!(decoded.channel, None);
        // A malformed channel is poison, not a silently dropped field.
        let mut v = serde_json::to_value(&back).unwrap();
        v["channel"] = "Not A Channel".into();
        assert_eq!(
            OrderCreateRequested::decode(&serde_json::to_vec(&v).unwrap())
                .unwrap_err()
                .code(),
            "INVALID_EVENT"
        );
    }

    #[test]
    fn classifies_poison() {
        assert_eq!(
            OrderCreateRequested::decode(b"{oops").unwrap_err().code(),
            "INVALID_JSON"
        );
        let mut v = serde_json::to_value(sample()).unwrap();
        v["schema_version"] = 3.into();
        assert_eq!(
            OrderCreateRequested::decode(&serde_json::to_vec(&v).unwrap()).unwrap_err(),
            PoisonReason::UnsupportedSchema(3)
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
