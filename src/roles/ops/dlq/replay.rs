//! The re-publication of a replay: the message as it was first sent (topic, tags, keys,
//! message_id) plus a replay id and count, rate-limited, each attempt audited under the
//! command's batch id, then the group's inbox watched for what came of it. A sample (the
//! oldest few) goes first; the rest only once every sample was seen applied.

use crate::domain::status::InboxStatus;
use std::time::Duration;

use super::checks::Checks;
use crate::config::Settings;
use crate::pg::replay::{self, ReplayRow};

/// The broker message of a replay: the original topic, tags, keys and message_id, plus
/// `replay_id` and `replay_count + 1` (in the properties, and in a JSON body's `replay_count`).
pub fn replay_message(row: &ReplayRow, replay_id: &str) -> crate::mq::OutMessage {
    let prop = |k: &str| {
        row.properties
            .get(k)
            .and_then(|v| v.as_str())
            .map(str::to_string)
    };
    let replay_count = prop("replay_count")
        .and_then(|v| v.parse::<i64>().ok())
        .unwrap_or(0)
        + 1;
    let mut body = row.payload.clone();
    if let Ok(serde_json::Value::Object(mut obj)) =
        serde_json::from_slice::<serde_json::Value>(&row.payload)
    {
        if obj.contains_key("replay_count") {
            obj.insert("replay_count".into(), replay_count.into());
            body = serde_json::to_vec(&obj).unwrap_or(body);
        }
    }
    let mut properties = vec![
        ("replay_id".to_string(), replay_id.to_string()),
        ("replay_count".to_string(), replay_count.to_string()),
    ];
    for key in [
        "message_id",
        "reservation_id",
        "order_id",
        "request_id",
        "schema_version",
        "traceparent",
        "event_type",
        "aggregate_version",
    ] {
        if let Some(v) = prop(key) {
            properties.push((key.to_string(), v));
        }
    }
    let keys: Vec<String> = prop("KEYS")
        .map(|k| {
            k.split(' ')
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    crate::mq::OutMessage {
        topic: row.topic.clone(),
        tag: prop("TAGS").unwrap_or_default(),
        keys,
        properties,
        body,
        deliver_time_ms: None,
        sharding_key: None,
    }
}

/// How a replay runs.
pub(super) struct Plan<'a> {
    pub(super) actor: &'a str,
    pub(super) reason: &'a str,
    pub(super) rate: f64,
    pub(super) force: bool,
    /// How long to watch the inbox for the effects.
    pub(super) verify: Duration,
    /// The command's `replay_batch_id`, on every audit row it writes.
    pub(super) batch_id: &'a str,
    /// Replayed first (the oldest); the rest only if each of them was seen applied (or found
    /// applied before). 0: all at once.
    pub(super) sample: usize,
    /// The groups whose effects show in `consumer_inbox` (order creation, timeout cancel):
    /// another group's replay is recorded `UNOBSERVABLE` and judged by its send alone.
    pub(super) inbox_groups: &'a [String],
    /// The batch's progress and an operator's pause (`replay_batches`).
    pub(super) gate: super::batches::Gate<'a>,
}

/// What a replay came to.
#[derive(Debug, Default)]
pub(super) struct Done {
    pub(super) confirmed: usize,
    pub(super) refused: usize,
    pub(super) failed: usize,
    pub(super) applied: usize,
    pub(super) duplicate: usize,
    pub(super) not_observed: usize,
    /// Confirmed to a group that keeps no inbox: no effect to watch.
    pub(super) unobservable: usize,
    /// Not sent: the sample before them did not all apply.
    pub(super) held_back: usize,
}

impl Done {
    /// Whether what was sent so far all went through: nothing refused, failed or unseen.
    fn clean(&self) -> bool {
        self.refused == 0 && self.failed == 0 && self.not_observed == 0
    }

    fn add(&mut self, o: Done) {
        self.confirmed += o.confirmed;
        self.refused += o.refused;
        self.failed += o.failed;
        self.applied += o.applied;
        self.duplicate += o.duplicate;
        self.not_observed += o.not_observed;
        self.unobservable += o.unobservable;
        self.held_back += o.held_back;
    }
}

/// A message replayed and confirmed, watched in its group's inbox afterwards.
type Watched = (String, String, String, bool);

/// What one row's replay came to.
enum Replayed {
    /// Not sent without `--force`, and why.
    Refused(String),
    Failed,
    /// Confirmed by the broker; watched when it has a message id.
    Confirmed(Option<Watched>),
}

/// Replays `rows` (oldest first): the sample, watched until each shows its effect or the
/// verify window passes, then, if the sample went through cleanly, the rest the same way.
pub(super) async fn replay(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    publisher: &dyn crate::mq::Publisher,
    mut rows: Vec<(ReplayRow, Checks)>,
    plan: &Plan<'_>,
) -> anyhow::Result<Done> {
    let rest = if plan.sample > 0 && rows.len() > plan.sample {
        rows.split_off(plan.sample)
    } else {
        Vec::new()
    };
    let mut done = send_and_watch(settings, client, publisher, rows, plan).await?;
    if rest.is_empty() {
        return Ok(done);
    }
    if !done.clean() {
        eprintln!(
            "the sample of {} did not all apply ({} refused, {} failed, {} not observed): the other {} are not sent",
            plan.sample, done.refused, done.failed, done.not_observed, rest.len()
        );
        done.held_back = rest.len();
        return Ok(done);
    }
    eprintln!(
        "the sample of {} applied; replaying the other {}",
        plan.sample,
        rest.len()
    );
    let more = send_and_watch(settings, client, publisher, rest, plan).await?;
    done.add(more);
    Ok(done)
}

/// Replays `rows` at most `rate` per second, then watches the inbox for each confirmed
/// replay's effect and records it on its audit row.
async fn send_and_watch(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    publisher: &dyn crate::mq::Publisher,
    rows: Vec<(ReplayRow, Checks)>,
    plan: &Plan<'_>,
) -> anyhow::Result<Done> {
    let bar = indicatif::ProgressBar::new(rows.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let pause = Duration::from_secs_f64(1.0 / plan.rate);
    let mut done = Done::default();
    // (replay_id, group, message_id, already applied before the replay)
    let mut watch: Vec<Watched> = Vec::new();
    for (row, checks) in rows {
        plan.gate.pass(client, &bar).await?;
        let replayed = replay_one(settings, client, publisher, &row, &checks, plan).await?;
        plan.gate.sent_one(client).await?;
        match replayed {
            Replayed::Refused(why) => {
                bar.println(format!("{}: refused, {why}; use --force", row.subject));
                done.refused += 1;
                bar.inc(1);
                continue;
            }
            Replayed::Failed => done.failed += 1,
            Replayed::Confirmed(watched) => {
                done.confirmed += 1;
                watch.extend(watched);
            }
        }
        bar.inc(1);
        tokio::time::sleep(pause).await;
    }
    bar.finish_with_message("sent; watching the inbox");
    let (watch, blind): (Vec<Watched>, Vec<Watched>) = watch
        .into_iter()
        .partition(|(_, group, ..)| plan.inbox_groups.contains(group));
    for (replay_id, ..) in &blind {
        replay::record_effect(client, replay_id, "UNOBSERVABLE").await?;
        done.unobservable += 1;
    }
    observe_effects(client, watch, plan.verify, &mut done).await?;
    Ok(done)
}

/// Why a row is not replayed without `--force`: older than the inbox's memory, or a schema
/// this build does not read.
fn refusal(
    settings: &Settings,
    row: &ReplayRow,
    checks: &Checks,
    plan: &Plan<'_>,
) -> Option<(&'static str, String)> {
    if plan.force {
        None
    } else if checks.older_than_inbox_retention {
        Some((
            "REFUSED_OLDER_THAN_RETENTION",
            format!(
                "first seen {} is older than the inbox retention ({} days)",
                row.first_seen, settings.retention.inbox_days
            ),
        ))
    } else if !checks.schema_known {
        Some((
            "REFUSED_SCHEMA_UNKNOWN",
            "its schema version is not one this build reads".to_string(),
        ))
    } else {
        None
    }
}

/// Sends one row again with its original message id (or records why not), audited either way.
async fn replay_one(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    publisher: &dyn crate::mq::Publisher,
    row: &ReplayRow,
    checks: &Checks,
    plan: &Plan<'_>,
) -> anyhow::Result<Replayed> {
    let replay_id = format!("rpl_{}", ulid::Ulid::new());
    let checks_json = serde_json::to_value(checks)?;
    let mut audit = replay::ReplayAudit {
        subject: row.subject.clone(),
        actor: plan.actor,
        reason: plan.reason,
        outcome: "",
        replay_id: &replay_id,
        batch_id: plan.batch_id,
        confirmed: false,
        checks: &checks_json,
    };
    if let Some((outcome, why)) = refusal(settings, row, checks, plan) {
        audit.outcome = outcome;
        replay::record(client, &audit).await?;
        return Ok(Replayed::Refused(why));
    }
    let outcome = publisher
        .send(
            replay_message(row, &replay_id),
            settings.mq.send_timeout_ms.max(1000),
        )
        .await;
    let confirmed = matches!(outcome, crate::mq::SendOutcome::Confirmed { .. });
    let forced = checks.older_than_inbox_retention || !checks.schema_known;
    let label = if forced {
        format!("{}_FORCED", outcome.label().to_uppercase())
    } else {
        outcome.label().to_uppercase()
    };
    audit.outcome = &label;
    audit.confirmed = confirmed;
    replay::record(client, &audit).await?;
    tracing::info!(subject = %row.subject, consumer_group = %row.consumer_group, topic = %row.topic,
                   message_id = row.message_id.as_deref().unwrap_or(""),
                   reservation_id = row.reservation_id.as_deref().unwrap_or(""),
                   order_id = row.order_id.as_deref().unwrap_or(""), replay_id = %replay_id,
                   previous_status = %row.status, outcome = %label, replay_batch_id = plan.batch_id,
                   already_applied = checks.already_applied.as_deref().unwrap_or(""),
                   "replayed");
    if !confirmed {
        return Ok(Replayed::Failed);
    }
    let watched = row.message_id.clone().map(|id| {
        (
            replay_id.clone(),
            row.consumer_group.clone(),
            id,
            checks.already_applied.is_some(),
        )
    });
    Ok(Replayed::Confirmed(watched))
}

/// Watches the groups' inbox until every replayed message shows up or `verify` passes, and
/// records each effect: `APPLIED:<decision>` (the replay was processed), `DUPLICATE` (the inbox
/// already held it: a no-op) or `NOT_OBSERVED` (not processed within the window).
async fn observe_effects(
    client: &tokio_postgres::Client,
    mut watch: Vec<Watched>,
    verify: Duration,
    done: &mut Done,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + verify;
    loop {
        let mut left = Vec::new();
        for (replay_id, group, message_id, before) in watch {
            let effect = if before {
                Some("DUPLICATE".to_string())
            } else {
                replay::inbox_state(client, &group, &message_id)
                    .await?
                    .filter(|(status, _)| status != InboxStatus::Processing.as_str())
                    .map(|(_, decision)| format!("APPLIED:{}", decision.unwrap_or_default()))
            };
            match effect {
                Some(effect) => {
                    if before {
                        done.duplicate += 1;
                    } else {
                        done.applied += 1;
                    }
                    replay::record_effect(client, &replay_id, &effect).await?;
                }
                None => left.push((replay_id, group, message_id, before)),
            }
        }
        watch = left;
        if watch.is_empty() || tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (replay_id, ..) in &watch {
        replay::record_effect(client, replay_id, "NOT_OBSERVED").await?;
        done.not_observed += 1;
    }
    Ok(())
}
