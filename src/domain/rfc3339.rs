//! Timestamps read from a message body the cheap way first: chrono's strict RFC 3339 parser
//! (what every producer of this project writes, `DateTime<Utc>`'s serialisation), then, for
//! anything it refuses, the relaxed reading serde's `DateTime<Utc>` does. What is accepted,
//! and the instant read, are the same as with serde's own; only the common case is cheaper
//! (the relaxed parser goes through chrono's generic format machinery for every timestamp,
//! three per order message on the consumer's hot path).

use std::fmt;

use chrono::{DateTime, FixedOffset, Utc};
use serde::de::{Deserializer, Error, Visitor};

/// `#[serde(deserialize_with = "crate::domain::rfc3339::deserialize")]` on a `DateTime<Utc>`.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DateTime<Utc>, D::Error> {
    d.deserialize_str(Rfc3339)
}

/// The reading itself: strict first, relaxed for the rest.
fn parse(s: &str) -> Result<DateTime<Utc>, chrono::ParseError> {
    DateTime::parse_from_rfc3339(s)
        .or_else(|_| s.parse::<DateTime<FixedOffset>>())
        .map(|t| t.with_timezone(&Utc))
}

struct Rfc3339;

impl Visitor<'_> for Rfc3339 {
    type Value = DateTime<Utc>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an RFC 3339 date and time")
    }

    fn visit_str<E: Error>(self, s: &str) -> Result<Self::Value, E> {
        parse(s).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Fast(#[serde(deserialize_with = "deserialize")] DateTime<Utc>);

    /// Both readings of one JSON value: the same instant, or both refuse it.
    fn both(json: &str) -> (Option<DateTime<Utc>>, Option<DateTime<Utc>>) {
        let fast = serde_json::from_str::<Fast>(json).ok().map(|f| f.0);
        let serde = serde_json::from_str::<DateTime<Utc>>(json).ok();
        (fast, serde)
    }

    #[test]
    fn reads_what_serde_reads_and_refuses_what_it_refuses() {
        for json in [
            r#""2026-12-05T10:00:00Z""#,
            r#""2026-12-05T10:00:00.123456789Z""#,
            r#""2026-12-05T10:00:00.5+08:00""#,
            r#""2026-12-05T10:00:00-03:30""#,
            r#""2026-12-05t10:00:00z""#,
            r#""2026-12-05 10:00:00Z""#,
            r#""2026-12-05T10:00:00 +08:00""#,
            r#""2026-12-05T10:00:00+0800""#,
            r#""2026-12-05T10:00:00\u005A""#,
            r#""2026-12-05T10:00:60Z""#,
            r#""2026-12-05T10:00:00""#,
            r#""2026-12-05""#,
            r#""yesterday""#,
            r#""""#,
            "12345",
            "null",
        ] {
            let (fast, serde) = both(json);
            assert_eq!(fast, serde, "{json}");
        }
        let (fast, _) = both(r#""2026-12-05T10:00:00.123+01:00""#);
        assert_eq!(
            fast.map(|t| t.timestamp_millis()),
            Some(1_796_464_800_123 - 3_600_000)
        );
    }

    #[test]
    fn what_this_project_writes_is_read_back_exactly() {
        let now = Utc::now();
        let json = serde_json::to_string(&now).unwrap();
        assert_eq!(serde_json::from_str::<Fast>(&json).unwrap().0, now);
    }
}
