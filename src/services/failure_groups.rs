//! Failures grouped by what failed (docs/RUNBOOK.md#dead-letters): the open dead letters and
//! the quarantined messages, each group's fingerprint its source (dead letter or quarantine),
//! consumer group, error class (or quarantine reason), error message with its ids and numbers
//! normalised away, and the body's `schema_version`. `seckill dlq groups` lists them, replays
//! and discards take a group by fingerprint, and the consume role exports each group's count.

use crate::domain::status::{DeadLetterStatus, QuarantineStatus};
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::pg::{dlq, quarantine};

/// Sample ids kept per group.
const SAMPLES: usize = 3;

/// One group of failures with the same fingerprint.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FailureGroup {
    /// 12 hex digits of SHA-256 over the fields below.
    pub fingerprint: String,
    /// `dead_letter` or `quarantined`.
    pub source: &'static str,
    pub consumer_group: String,
    /// The dead letter's error class, or the quarantine reason.
    pub class: String,
    /// The error with ids and numbers replaced (`<id>`, `<n>`).
    pub message: String,
    /// The body's `schema_version`, when the body is JSON that has one.
    pub schema_version: Option<i64>,
    pub count: usize,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
    /// The oldest few `dlq_id`s (or quarantine ids).
    pub samples: Vec<i64>,
    /// Every id of the group, oldest first (what a replay or discard by fingerprint takes).
    #[serde(skip)]
    pub members: Vec<i64>,
}

/// One failure as grouping reads it.
struct Failure<'a> {
    source: &'static str,
    id: i64,
    consumer_group: &'a str,
    class: &'a str,
    error: &'a str,
    payload: &'a str,
    at: DateTime<Utc>,
}

/// `error` with every word that holds a digit replaced: `<n>` for a number, `<id>` for an id
/// (`ord_01J...`, a hex digest, a ULID), so that failures differing only in which order or
/// how many milliseconds fall in one group.
pub fn normalise(error: &str) -> String {
    let mut out = String::with_capacity(error.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.bytes().any(|b| b.is_ascii_digit()) {
            let number = word.bytes().all(|b| b.is_ascii_digit() || b == b'.');
            out.push_str(if number { "<n>" } else { "<id>" });
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in error.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

fn schema_version(payload: &str) -> Option<i64> {
    serde_json::from_str::<serde_json::Value>(payload)
        .ok()?
        .get("schema_version")?
        .as_i64()
}

fn fingerprint(parts: [&str; 5]) -> String {
    let digest = Sha256::digest(parts.join("\u{1f}").as_bytes());
    hex::encode(&digest[..6])
}

/// Groups `failures` by fingerprint, the largest group first.
fn group<'a>(failures: impl Iterator<Item = Failure<'a>>) -> Vec<FailureGroup> {
    let mut groups: BTreeMap<String, FailureGroup> = BTreeMap::new();
    for f in failures {
        let message = normalise(f.error);
        let schema = schema_version(f.payload);
        let schema_text = schema.map(|v| v.to_string()).unwrap_or_default();
        let key = fingerprint([f.source, f.consumer_group, f.class, &message, &schema_text]);
        let g = groups.entry(key.clone()).or_insert_with(|| FailureGroup {
            fingerprint: key,
            source: f.source,
            consumer_group: f.consumer_group.to_string(),
            class: f.class.to_string(),
            message,
            schema_version: schema,
            count: 0,
            first_seen: f.at,
            last_seen: f.at,
            samples: Vec::new(),
            members: Vec::new(),
        });
        g.count += 1;
        g.first_seen = g.first_seen.min(f.at);
        g.last_seen = g.last_seen.max(f.at);
        // The listings come oldest first: the first ids seen are the oldest.
        if g.samples.len() < SAMPLES {
            g.samples.push(f.id);
        }
        g.members.push(f.id);
    }
    let mut out: Vec<FailureGroup> = groups.into_values().collect();
    out.sort_by(|a, b| b.count.cmp(&a.count).then(a.first_seen.cmp(&b.first_seen)));
    out
}

/// The OPEN dead letters and the QUARANTINED messages (of `consumer_group`, at most `limit` of
/// each, oldest first) in groups.
pub async fn failure_groups(
    client: &tokio_postgres::Client,
    consumer_group: Option<&str>,
    limit: i64,
) -> anyhow::Result<Vec<FailureGroup>> {
    let dead = dlq::list(
        client,
        Some(DeadLetterStatus::Open.as_str()),
        consumer_group,
        limit,
    )
    .await?;
    let held = quarantine::list(
        client,
        Some(QuarantineStatus::Quarantined.as_str()),
        consumer_group,
        limit,
    )
    .await?;
    let dead = dead.iter().map(|d| Failure {
        source: "dead_letter",
        id: d.dlq_id,
        consumer_group: &d.consumer_group,
        class: d.error_class.as_deref().unwrap_or("UNKNOWN"),
        error: d.last_error.as_deref().unwrap_or(""),
        payload: &d.payload,
        at: d.first_seen,
    });
    let held = held.iter().map(|q| Failure {
        source: "quarantined",
        id: q.quarantine_id,
        consumer_group: &q.consumer_group,
        class: &q.reason,
        error: &q.error,
        payload: &q.payload,
        at: q.received_at,
    });
    Ok(group(dead.chain(held)))
}

/// The open group with this fingerprint (reading at most `limit` rows of each table), with
/// every member; an error naming the fingerprint when no open group has it.
pub async fn by_fingerprint(
    client: &tokio_postgres::Client,
    fingerprint: &str,
    limit: i64,
) -> anyhow::Result<FailureGroup> {
    failure_groups(client, None, limit)
        .await?
        .into_iter()
        .find(|g| g.fingerprint == fingerprint)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no open group of failures has the fingerprint {fingerprint} \
                 (`seckill dlq groups` lists them)"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_numbers_are_normalised_away() {
        assert_eq!(
            normalise("order ord_01J9ZQ4X2M not found after 2000 ms (attempt 3)"),
            "order <id> not found after <n> ms (attempt <n>)"
        );
        assert_eq!(
            normalise("duplicate key value violates unique constraint \"orders_pkey\""),
            "duplicate key value violates unique constraint \"orders_pkey\""
        );
        assert_eq!(normalise("took 1.5 s"), "took <n> s");
    }

    fn failure(
        id: i64,
        class: &'static str,
        error: &'static str,
        payload: &'static str,
    ) -> Failure<'static> {
        Failure {
            source: "dead_letter",
            id,
            consumer_group: "CG",
            class,
            error,
            payload,
            at: DateTime::from_timestamp(1_700_000_000 + id, 0).unwrap(),
        }
    }

    #[test]
    fn failures_differing_only_in_ids_fall_in_one_group() {
        let v1 = r#"{"schema_version":1}"#;
        let groups = group(
            [
                failure(1, "PERMANENT", "order ord_01A not found", v1),
                failure(2, "PERMANENT", "order ord_01B not found", v1),
                failure(
                    3,
                    "PERMANENT",
                    "order ord_01C not found",
                    r#"{"schema_version":2}"#,
                ),
                failure(4, "TRANSIENT", "order ord_01D not found", v1),
                failure(5, "PERMANENT", "order ord_01E not found", v1),
                failure(6, "PERMANENT", "order ord_01F not found", v1),
            ]
            .into_iter(),
        );
        let counts: Vec<(usize, &str, Option<i64>)> = groups
            .iter()
            .map(|g| (g.count, g.class.as_str(), g.schema_version))
            .collect();
        assert_eq!(
            counts,
            vec![
                (4, "PERMANENT", Some(1)),
                (1, "PERMANENT", Some(2)),
                (1, "TRANSIENT", Some(1))
            ]
        );
        assert_eq!(groups[0].samples, vec![1, 2, 5], "the oldest three");
        assert_eq!(
            groups[0].members,
            vec![1, 2, 5, 6],
            "every member, oldest first"
        );
        assert_eq!(groups[0].message, "order <id> not found");
        assert_eq!(groups[0].last_seen.timestamp(), 1_700_000_006);
        assert_eq!(groups[0].fingerprint.len(), 12);
        assert_ne!(groups[0].fingerprint, groups[1].fingerprint);
    }
}
