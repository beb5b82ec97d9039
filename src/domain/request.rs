//! Validation of the buyer's reservation request. Anything that fails here is a 400 with
//! `INVALID_REQUEST` and nothing is written anywhere.

use serde::Deserialize;
use thiserror::Error;

/// Longest accepted `request_id`; clients use UUIDs or ULIDs, far shorter.
pub const MAX_REQUEST_ID_LEN: usize = 64;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum ValidationError {
    #[error("body is not valid JSON: {0}")]
    Json(String),
    #[error("field `{0}` is missing")]
    Missing(&'static str),
    #[error("field `{field}` {reason}")]
    Field {
        field: &'static str,
        reason: &'static str,
    },
    #[error("body exceeds {0} bytes")]
    TooLarge(usize),
    #[error("path segment `{0}` must be a positive integer")]
    Path(&'static str),
}

/// The wire form: everything optional so that a missing field gets its own message (`user_id`
/// is read from the object itself).
#[derive(Debug, Deserialize)]
struct RawReserve {
    request_id: Option<serde_json::Value>,
    quantity: Option<serde_json::Value>,
    channel: Option<serde_json::Value>,
}

/// A validated reservation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveRequest {
    /// The buyer the body names. With token identity it may be left out (the token names the
    /// buyer) and must match the token when present.
    pub user_id: Option<i64>,
    pub request_id: String,
    pub quantity: i32,
    /// The sales channel the buyer reserves through (`app`, `web`, ...), when named.
    pub channel: Option<String>,
}

fn positive_i64(v: &serde_json::Value, field: &'static str) -> Result<i64, ValidationError> {
    match v.as_i64() {
        Some(n) if n > 0 => Ok(n),
        _ => Err(ValidationError::Field {
            field,
            reason: "must be a positive integer",
        }),
    }
}

impl ReserveRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ValidationError> {
        let value: serde_json::Value =
            serde_json::from_slice(body).map_err(|e| ValidationError::Json(e.to_string()))?;
        if !value.is_object() {
            // serde would also take the positional form `[user_id, request_id, quantity]`.
            return Err(ValidationError::Json(
                "the body must be a JSON object".into(),
            ));
        }
        let value_user_id = value.get("user_id").cloned();
        let raw =
            RawReserve::deserialize(value).map_err(|e| ValidationError::Json(e.to_string()))?;
        // Optional, but when given a positive integer (`null` is not a buyer).
        // (serde reads a JSON `null` as a missing field: look at the object itself.)
        let user_id = match value_user_id.as_ref() {
            None => None,
            Some(v) => Some(positive_i64(v, "user_id")?),
        };
        let request_id = match raw
            .request_id
            .ok_or(ValidationError::Missing("request_id"))?
        {
            serde_json::Value::String(s) => s,
            _ => {
                return Err(ValidationError::Field {
                    field: "request_id",
                    reason: "must be a string",
                })
            }
        };
        if request_id.is_empty() || request_id.len() > MAX_REQUEST_ID_LEN {
            return Err(ValidationError::Field {
                field: "request_id",
                reason: "must be 1-64 characters",
            });
        }
        if !request_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        {
            return Err(ValidationError::Field {
                field: "request_id",
                reason: "may only contain A-Z a-z 0-9 - _ . :",
            });
        }
        let quantity = raw.quantity.ok_or(ValidationError::Missing("quantity"))?;
        if quantity.as_i64() != Some(1) {
            return Err(ValidationError::Field {
                field: "quantity",
                reason: "must be 1",
            });
        }
        let channel = match raw.channel {
            None => None,
            Some(serde_json::Value::String(c))
                if crate::domain::order_create::is_valid_channel(&c) =>
            {
                Some(c)
            }
            Some(_) => {
                return Err(ValidationError::Field {
                    field: "channel",
                    reason: "must be 1-32 characters of a-z 0-9 _ -",
                })
            }
        };
        Ok(Self {
            user_id,
            request_id,
            quantity: 1,
            channel,
        })
    }
}

/// Parses a path id: a positive integer that fits in i64.
pub fn parse_path_id(s: &str, name: &'static str) -> Result<i64, ValidationError> {
    // Canonical decimal only: no sign, no leading zero (`+1` and `01` are not ids).
    if s.is_empty() || s.starts_with('0') || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ValidationError::Path(name));
    }
    match s.parse::<i64>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(ValidationError::Path(name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_a_good_request() {
        let r = ReserveRequest::parse(br#"{"user_id": 7, "request_id": "req-1", "quantity": 1}"#)
            .unwrap();
        assert_eq!(r.user_id, Some(7));
        assert_eq!(r.request_id, "req-1");
        let r = ReserveRequest::parse(br#"{"request_id": "req-1", "quantity": 1}"#).unwrap();
        assert_eq!(r.user_id, None);
        assert_eq!(r.channel, None);
        let r = ReserveRequest::parse(
            br#"{"request_id": "r", "quantity": 1, "channel": "mini_program"}"#,
        )
        .unwrap();
        assert_eq!(r.channel.as_deref(), Some("mini_program"));
    }

    fn field(field: &'static str, reason: &'static str) -> ValidationError {
        ValidationError::Field { field, reason }
    }

    fn assert_rejected(cases: &[(&[u8], ValidationError)]) {
        for (body, want) in cases {
            assert_eq!(
                ReserveRequest::parse(body).unwrap_err(),
                *want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn rejects_a_missing_field_or_a_bad_buyer_with_its_reason() {
        let positive = || field("user_id", "must be a positive integer");
        assert_rejected(&[
            (
                br#"{"user_id":1,"quantity":1}"#,
                ValidationError::Missing("request_id"),
            ),
            (
                br#"{"user_id":1,"request_id":"a"}"#,
                ValidationError::Missing("quantity"),
            ),
            (
                br#"{"user_id":0,"request_id":"a","quantity":1}"#,
                positive(),
            ),
            (
                br#"{"user_id":null,"request_id":"a","quantity":1}"#,
                positive(),
            ),
            (
                br#"{"user_id":-5,"request_id":"a","quantity":1}"#,
                positive(),
            ),
            (
                br#"{"user_id":"5","request_id":"a","quantity":1}"#,
                positive(),
            ),
            (
                br#"{"user_id":99999999999999999999,"request_id":"a","quantity":1}"#,
                positive(),
            ),
        ]);
    }

    #[test]
    fn rejects_a_bad_quantity_request_id_or_channel_with_its_reason() {
        let channel = || field("channel", "must be 1-32 characters of a-z 0-9 _ -");
        assert_rejected(&[
            (
                br#"{"user_id":1,"request_id":"a","quantity":2}"#,
                field("quantity", "must be 1"),
            ),
            (
                br#"{"user_id":1,"request_id":"","quantity":1}"#,
                field("request_id", "must be 1-64 characters"),
            ),
            (
                br#"{"user_id":1,"request_id":7,"quantity":1}"#,
                field("request_id", "must be a string"),
            ),
            (
                br#"{"user_id":1,"request_id":"a","quantity":1,"channel":"App Store"}"#,
                channel(),
            ),
            (
                br#"{"user_id":1,"request_id":"a","quantity":1,"channel":""}"#,
                channel(),
            ),
            (
                br#"{"user_id":1,"request_id":"a","quantity":1,"channel":7}"#,
                channel(),
            ),
            (
                "{\"user_id\":1,\"request_id\":\"\u{e9}\",\"quantity\":1}".as_bytes(),
                field("request_id", "may only contain A-Z a-z 0-9 - _ . :"),
            ),
        ]);
    }

    #[test]
    fn rejects_what_is_not_a_json_object() {
        assert!(matches!(
            ReserveRequest::parse(b"{not json"),
            Err(ValidationError::Json(_))
        ));
        assert!(matches!(
            ReserveRequest::parse(b"[]"),
            Err(ValidationError::Json(_))
        ));
        // serde's positional form of the struct is not an accepted body.
        assert!(matches!(
            ReserveRequest::parse(br#"[424242,"arr-1",1]"#),
            Err(ValidationError::Json(_))
        ));
    }

    #[test]
    fn path_ids_must_be_positive() {
        assert_eq!(parse_path_id("10001", "activity_id"), Ok(10001));
        assert!(parse_path_id("0", "activity_id").is_err());
        assert!(parse_path_id("-1", "activity_id").is_err());
        assert!(parse_path_id("99999999999999999999", "activity_id").is_err());
        assert!(parse_path_id("abc", "activity_id").is_err());
        assert!(parse_path_id("+1", "activity_id").is_err());
        assert!(parse_path_id("01", "activity_id").is_err());
        assert!(parse_path_id("", "activity_id").is_err());
    }
}
