//! `seckill dlq replay --from-archive`: events the outbox sent, read back from the archive
//! retention wrote before deleting them (docs/architecture/postgresql.md#the-archive), for a
//! downstream that lost them after the broker's retention let them go. Each is replayed as a
//! dead letter is: its own message id, the same pre-checks, audited with where it was archived
//! (`archive:<segment>#<row>`).

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

use crate::archive::Archive;
use crate::config::Settings;
use crate::pg::replay::{ReplayRow, Subject};

/// What to read back.
pub(super) struct ArchiveSelection<'a> {
    /// The consumer group to replay to (default: the projection); its topic's events are read.
    pub(super) group: Option<&'a str>,
    pub(super) since: DateTime<Utc>,
    pub(super) until: DateTime<Utc>,
    pub(super) key: Option<&'a str>,
    pub(super) max: usize,
}

/// The archived outbox rows of the group's topic created in the window, as replay rows.
pub(super) fn rows(
    settings: &Settings,
    sel: &ArchiveSelection<'_>,
) -> anyhow::Result<Vec<ReplayRow>> {
    anyhow::ensure!(sel.since < sel.until, "--since must be before --until");
    let names = settings.names();
    let group = sel.group.unwrap_or(&names.projection_group);
    let (group, topic) = &super::source::group_and_topic(names, group)?;
    let archive = Archive::of(settings);
    let mut out = Vec::new();
    // The outbox's archived rows: from the by-day table, and from the unpartitioned one that
    // releases before V25 wrote (docs/architecture/postgresql.md#tables-by-day).
    let mut segments = archive.list(Some("event_outbox_by_day"))?;
    segments.extend(archive.list(Some("event_outbox"))?);
    for m in segments {
        let overlaps =
            m.oldest_at.is_none_or(|o| o < sel.until) && m.newest_at.is_none_or(|n| n >= sel.since);
        if !overlaps {
            continue;
        }
        for (i, r) in archive.read(&m)?.into_iter().enumerate() {
            let created = r["created_at"]
                .as_str()
                .and_then(|t| t.parse::<DateTime<Utc>>().ok());
            let in_window = created.is_some_and(|t| t >= sel.since && t < sel.until);
            if !in_window || r["topic"].as_str() != Some(topic.as_str()) {
                continue;
            }
            if sel.key.is_some_and(|k| !carries_key(&r, k)) {
                continue;
            }
            if out.len() == sel.max {
                eprintln!("--max {} reached: later archived events are left", sel.max);
                return Ok(out);
            }
            out.push(row(
                group,
                &m.segment_id,
                i + 1,
                &r,
                created.unwrap_or_default(),
            ));
        }
    }
    eprintln!(
        "read {} archived event(s) of {topic} created {} .. {} from {}",
        out.len(),
        sel.since.to_rfc3339(),
        sel.until.to_rfc3339(),
        archive.root().display()
    );
    Ok(out)
}

fn carries_key(r: &Value, key: &str) -> bool {
    ["event_id", "message_key", "aggregate_id"]
        .iter()
        .any(|f| r[*f].as_str() == Some(key))
}

/// An archived outbox row as the message the relay sent: its event id as `message_id`, its tag
/// and key, the payload's schema version.
fn row(group: &str, segment: &str, line: usize, r: &Value, created: DateTime<Utc>) -> ReplayRow {
    let text = |f: &str| r[f].as_str().map(str::to_string);
    let payload = &r["payload"];
    let mut properties = json!({
        "message_id": text("event_id"),
        "TAGS": text("tag"),
        "KEYS": text("message_key"),
        "event_type": payload["event_type"],
    });
    if let Some(v) = r["aggregate_version"].as_i64() {
        properties["aggregate_version"] = json!(v.to_string());
    }
    ReplayRow {
        subject: Subject::Source(format!("archive:{segment}#{line}")),
        consumer_group: group.to_string(),
        topic: text("topic").unwrap_or_default(),
        message_id: text("event_id"),
        reservation_id: payload["reservation_id"].as_str().map(str::to_string),
        order_id: text("aggregate_id"),
        properties,
        first_seen: created,
        status: "ARCHIVED".into(),
        payload: serde_json::to_vec(payload).unwrap_or_default(),
    }
}
