//! `seckill dlq replay --from-source`: what a consumer group should have applied, read back from
//! its source topic (docs/architecture/recovery.md#dead-letters). The broker keeps every message
//! for its retention whatever the group's offsets say, so a window of the topic (narrowed to one
//! business key if given) is read through the replay group (`Names::replay_group`, its own offsets:
//! the live group's are never moved) and each message the group's inbox does not hold is sent again
//! with its own message_id, exactly as a dead letter's replay is: the inbox makes a message applied
//! twice impossible, the audit names each by where the broker stored it.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::config::Settings;
use crate::mq::Delivery;
use crate::pg::replay::{ReplayRow, Subject};

/// How long reading the window may take.
const READ_DEADLINE: Duration = Duration::from_secs(120);

/// What to read back.
pub(super) struct SourceSelection<'a> {
    /// The consumer group whose topic is read (default: order creation).
    pub(super) group: Option<&'a str>,
    pub(super) since: DateTime<Utc>,
    pub(super) until: DateTime<Utc>,
    /// Only messages carrying this business key: message, reservation, order or request id,
    /// or one of the message's keys.
    pub(super) key: Option<&'a str>,
    /// At most this many.
    pub(super) max: usize,
}

/// The messages of the window, as replay rows of the source group.
pub(super) async fn rows(
    settings: &Settings,
    sel: &SourceSelection<'_>,
) -> anyhow::Result<Vec<ReplayRow>> {
    anyhow::ensure!(sel.since < sel.until, "--since must be before --until");
    let names = settings.names();
    let group = sel.group.unwrap_or(&names.order_create_group);
    let (group, topic) = &group_and_topic(names, group)?;
    let rt = crate::mq::runtime()?;
    let ns = settings.mq.name_server_list();
    // The broker creates no group by itself: a missing replay group would fail every pull.
    for broker in settings.mq.broker_addrs() {
        if crate::mq::group_facts(&rt, &ns, broker, &names.replay_group)
            .await?
            .is_none()
        {
            anyhow::bail!(
                "the replay group {} does not exist on {broker}: run `seckill topics create`",
                names.replay_group
            );
        }
    }
    let window = crate::mq::read_window(
        &rt,
        &ns,
        &names.replay_group,
        topic,
        (sel.since.timestamp_millis(), sel.until.timestamp_millis()),
        sel.max,
        READ_DEADLINE,
    )
    .await?;
    eprintln!(
        "read {} message(s) stored {} .. {} from {} queue(s) of {topic}{}",
        window.messages.len(),
        sel.since.to_rfc3339(),
        sel.until.to_rfc3339(),
        window.queues,
        if window.left_out > 0 {
            format!(" ({} more past --max)", window.left_out)
        } else {
            String::new()
        }
    );
    Ok(window
        .messages
        .into_iter()
        .filter(|d| sel.key.is_none_or(|k| carries_key(d, k)))
        .map(|d| row(group, d))
        .collect())
}

/// `(group, the topic it consumes)` of a `--group` an operator named, or an error listing the
/// environment's groups.
pub(super) fn group_and_topic(
    names: &crate::config::Names,
    group: &str,
) -> anyhow::Result<(String, String)> {
    let sources = names.dead_letter_sources();
    let Some(found) = sources.iter().find(|(g, _)| g == group) else {
        let known: Vec<&str> = sources.iter().map(|(g, _)| g.as_str()).collect();
        anyhow::bail!("--group {group} is not one of this environment's groups: {known:?}");
    };
    Ok(found.clone())
}

/// Whether `d` carries business key `key`.
fn carries_key(d: &Delivery, key: &str) -> bool {
    ["message_id", "reservation_id", "order_id", "request_id"]
        .iter()
        .any(|p| d.properties.get(p) == Some(key))
        || d.keys.split(' ').any(|k| k == key)
}

fn row(group: &str, d: Delivery) -> ReplayRow {
    let prop = |k: &str| d.properties.get(k).map(str::to_owned);
    let at = format!(
        "{}@{}:{}:{}",
        d.topic, d.broker_name, d.queue_id, d.queue_offset
    );
    ReplayRow {
        subject: Subject::Source(at),
        consumer_group: group.to_string(),
        topic: d.topic.clone(),
        message_id: prop("message_id"),
        reservation_id: prop("reservation_id")
            .or_else(|| d.keys.split(' ').next().map(str::to_string)),
        order_id: prop("order_id"),
        properties: serde_json::to_value(&d.properties).unwrap_or_default(),
        first_seen: DateTime::from_timestamp_millis(d.store_timestamp_ms).unwrap_or_default(),
        status: "STORED".into(),
        payload: d.body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_matches_any_business_id_or_message_key() {
        let mut d = Delivery {
            keys: "rsv_a ord_b".into(),
            ..Default::default()
        };
        d.properties.insert("message_id", "evt_c");
        d.properties.insert("request_id", "req-1");
        for k in ["rsv_a", "ord_b", "evt_c", "req-1"] {
            assert!(carries_key(&d, k), "{k}");
        }
        assert!(!carries_key(&d, "rsv"));
        assert!(!carries_key(&d, ""));
    }

    #[test]
    fn a_row_names_where_the_broker_stored_it() {
        let mut d = Delivery {
            topic: "T_SECKILL_ORDER_CREATE_V1".into(),
            keys: "rsv_a".into(),
            broker_name: "seckill-broker-a".into(),
            queue_id: 3,
            queue_offset: 41,
            store_timestamp_ms: 1_700_000_000_000,
            body: b"{}".to_vec(),
            ..Default::default()
        };
        d.properties.insert("message_id", "evt_c");
        let r = row("CG_T_SECKILL_ORDER_CREATE_PG_V1", d);
        assert_eq!(
            r.subject,
            Subject::Source("T_SECKILL_ORDER_CREATE_V1@seckill-broker-a:3:41".into())
        );
        assert_eq!(r.message_id.as_deref(), Some("evt_c"));
        assert_eq!(r.reservation_id.as_deref(), Some("rsv_a"));
        assert_eq!(r.first_seen.timestamp_millis(), 1_700_000_000_000);
    }
}
