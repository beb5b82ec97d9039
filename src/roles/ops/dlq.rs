//! `seckill dlq list | show | replay | discard`: the operator's side of the dead letters that
//! the intake (in `seckill consume`, `roles::consume::dlq_intake`) recorded in PostgreSQL.

use std::time::Duration;

use clap::Subcommand;
use serde::Serialize;

use crate::config::Settings;
use crate::pg::dlq;
use crate::pg::order_tx::TxNames;

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Dead letters, oldest first.
    List {
        /// OPEN, REPLAYED or DISCARDED (default: OPEN).
        #[arg(long, default_value = "OPEN")]
        status: String,
        /// Only this consumer group.
        #[arg(long)]
        group: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// One dead letter with its payload.
    Show { dlq_id: i64 },
    /// Re-publish dead letters to their original topic with their original message_id plus
    /// `replay_id` and `replay_count + 1` (rate-limited, one audit row each).
    Replay {
        /// Dead letters by id (OPEN or already REPLAYED).
        #[arg(long = "id")]
        ids: Vec<i64>,
        /// All OPEN dead letters of this group (with --since/--until).
        #[arg(long)]
        group: Option<String>,
        /// First-seen window start (RFC 3339).
        #[arg(long)]
        since: Option<chrono::DateTime<chrono::Utc>>,
        /// First-seen window end (RFC 3339).
        #[arg(long)]
        until: Option<chrono::DateTime<chrono::Utc>>,
        /// Why (kept in the audit; not needed with --dry-run).
        #[arg(long, required_unless_present = "dry_run")]
        reason: Option<String>,
        #[arg(long)]
        actor: Option<String>,
        /// Messages per second at most.
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// Replay even what is older than the inbox retention (it may apply twice), or whose
        /// schema this build does not know (the consumer will quarantine it).
        #[arg(long)]
        force: bool,
        /// Only show what the pre-checks find (already applied? reservation still held?
        /// schema known? older than the inbox retention?); nothing is sent or recorded.
        #[arg(long)]
        dry_run: bool,
        /// The pre-checks as JSON (with --dry-run).
        #[arg(long)]
        json: bool,
        /// After the sends, how long to watch the group's inbox for each replay's effect
        /// (recorded on its audit row: APPLIED:<decision>, DUPLICATE or NOT_OBSERVED).
        #[arg(long, default_value_t = 10)]
        verify_secs: u64,
    },
    /// Give up on a dead letter (audited). An order-create dead letter's message is withdrawn
    /// with it, so its reservation's unit goes back once, through compensation.
    Discard {
        dlq_id: i64,
        #[arg(long)]
        reason: String,
        /// Who decided (default: $USER).
        #[arg(long)]
        actor: Option<String>,
    },
}

/// `seckill dlq ...`. Returns false when the command found nothing to act on.
pub async fn run(settings: Settings, cmd: DlqCommand) -> anyhow::Result<bool> {
    let (mut client, conn) = crate::pg::connect_one(&settings.pg).await?;
    let conn = tokio::spawn(conn);
    let ok = match cmd {
        DlqCommand::List {
            status,
            group,
            limit,
            json,
        } => {
            let status = status.to_uppercase();
            anyhow::ensure!(
                ["OPEN", "REPLAYED", "DISCARDED"].contains(&status.as_str()),
                "--status must be OPEN, REPLAYED or DISCARDED"
            );
            let rows = dlq::list(&client, Some(&status), group.as_deref(), limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                println!(
                    "{:>6}  {:<20}  {:<40}  {:>8}  {:<10}  error",
                    "id", "first seen", "group / message_id", "attempts", "status"
                );
                for r in &rows {
                    println!(
                        "{:>6}  {:<20}  {:<40}  {:>8}  {:<10}  {}",
                        r.dlq_id,
                        r.first_seen.format("%Y-%m-%d %H:%M:%S"),
                        format!(
                            "{} / {}",
                            r.consumer_group,
                            r.message_id.as_deref().unwrap_or("-")
                        ),
                        r.attempts,
                        r.status,
                        r.last_error.as_deref().unwrap_or("-")
                    );
                }
                println!("{} dead letter(s)", rows.len());
            }
            true
        }
        DlqCommand::Show { dlq_id } => match dlq::show(&client, dlq_id).await? {
            Some(r) => {
                println!("{}", serde_json::to_string_pretty(&r)?);
                true
            }
            None => {
                eprintln!("no dead letter {dlq_id}");
                false
            }
        },
        DlqCommand::Replay {
            ids,
            group,
            since,
            until,
            reason,
            actor,
            rate,
            force,
            dry_run,
            json,
            verify_secs,
        } => {
            let reason = reason.unwrap_or_default();
            anyhow::ensure!(
                dry_run || !reason.trim().is_empty(),
                "--reason must say why"
            );
            anyhow::ensure!(rate > 0.0, "--rate must be positive");
            anyhow::ensure!(
                !ids.is_empty() || group.is_some() || since.is_some(),
                "select dead letters with --id, --group or --since"
            );
            let actor = actor
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "unknown".into());
            let rows =
                dlq::select_for_replay(&client, &ids, group.as_deref(), since, until).await?;
            let checks = pre_checks(&settings, &client, &rows).await?;
            if dry_run {
                print_checks(&checks, json)?;
                !rows.is_empty()
            } else {
                let publisher = crate::mq::connect_publisher(&settings).await?;
                let plan = Plan {
                    actor: &actor,
                    reason: &reason,
                    rate,
                    force,
                    verify: Duration::from_secs(verify_secs),
                };
                let done = replay(
                    &settings,
                    &mut client,
                    publisher.as_ref(),
                    rows.into_iter().zip(checks).collect(),
                    &plan,
                )
                .await?;
                println!(
                    "replay: {} confirmed ({} applied, {} duplicate, {} not observed within {verify_secs} s), {} refused, {} failed",
                    done.confirmed, done.applied, done.duplicate, done.not_observed, done.refused, done.failed
                );
                done.failed == 0 && done.refused == 0
            }
        }
        DlqCommand::Discard {
            dlq_id,
            reason,
            actor,
        } => {
            anyhow::ensure!(!reason.trim().is_empty(), "--reason must say why");
            let actor = actor
                .or_else(|| std::env::var("USER").ok())
                .unwrap_or_else(|| "unknown".into());
            let pool = crate::pg::connect_pool(&settings.pg, 1).await?;
            let mut c = pool.get().await?;
            let order_create = TxNames::order_create(&settings);
            match dlq::discard(&mut c, &order_create, dlq_id, &actor, &reason).await? {
                Some(effect) => {
                    let what = match effect {
                        dlq::effect::WITHDRAWN => "its message withdrawn: the reservation's unit goes back through compensation",
                        dlq::effect::ALREADY_DECIDED => "another copy of its message was already decided; nothing held",
                        dlq::effect::UNREADABLE => "its payload does not decode; no reservation to release",
                        _ => "nothing held by it",
                    };
                    println!(
                        "dead letter {dlq_id} discarded by {actor}: {reason}; {what} ({effect})"
                    );
                    true
                }
                None => {
                    eprintln!("dead letter {dlq_id} is not OPEN (or does not exist)");
                    false
                }
            }
        }
    };
    drop(client);
    let _ = conn.await;
    Ok(ok)
}

/// The broker message of a replay: the original topic, tags, keys and message_id, plus
/// `replay_id` and `replay_count + 1` (in the properties, and in a JSON body's `replay_count`).
pub fn replay_message(row: &dlq::ReplayRow, replay_id: &str) -> crate::mq::OutMessage {
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

/// What the pre-checks found about one dead letter before a replay (`dlq_audit.checks`).
#[derive(Debug, Clone, Serialize)]
pub struct Checks {
    pub dlq_id: i64,
    pub consumer_group: String,
    pub message_id: Option<String>,
    /// The group's inbox already holds the message (`status/decision`): a replay is a no-op.
    pub already_applied: Option<String>,
    /// Order-create only: the reservation in Redis (`RESERVED`: its unit is still held;
    /// `RELEASED`; `MISSING`), or why it could not be read.
    pub reservation: Option<String>,
    /// The payload carries a schema version this build reads.
    pub schema_known: bool,
    /// First seen longer ago than the inbox retention: the inbox may not recognise a duplicate.
    pub older_than_inbox_retention: bool,
}

/// Runs the pre-checks of a replay: PostgreSQL's inbox, Redis's reservation, the payload.
pub async fn pre_checks(
    settings: &Settings,
    client: &tokio_postgres::Client,
    rows: &[dlq::ReplayRow],
) -> anyhow::Result<Vec<Checks>> {
    let order_create = settings.names().order_create_group;
    let retention = chrono::Duration::from_std(crate::config::RetentionSettings::age(
        settings.retention.inbox_days,
    ))?;
    let redis = if rows.iter().any(|r| r.consumer_group == order_create) {
        Some(crate::redis::RedisStore::connect(&settings.redis).await)
    } else {
        None
    };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let already_applied = match &row.message_id {
            Some(id) => dlq::inbox_state(client, &row.consumer_group, id)
                .await?
                .map(|(status, decision)| format!("{status}/{}", decision.unwrap_or_default())),
            None => None,
        };
        let event = (row.consumer_group == order_create)
            .then(|| crate::domain::OrderCreateRequested::decode(&row.payload).ok())
            .flatten();
        let reservation = match (&redis, &event) {
            (Some(Ok(redis)), Some(e)) => Some(
                match redis.reservation(e.activity_id, &e.reservation_id).await {
                    Ok(h) => h.get("status").cloned().unwrap_or_else(|| "MISSING".into()),
                    Err(err) => format!("unreadable: {err}"),
                },
            ),
            (Some(Err(err)), _) => Some(format!("unreadable: {err}")),
            (Some(Ok(_)), None) => Some("unknown: the payload does not decode".into()),
            (None, _) => None,
        };
        let schema_known = if row.consumer_group == order_create {
            event.is_some()
        } else {
            schema_version(row) == Some(i64::from(crate::domain::SCHEMA_VERSION))
        };
        out.push(Checks {
            dlq_id: row.dlq_id,
            consumer_group: row.consumer_group.clone(),
            message_id: row.message_id.clone(),
            already_applied,
            reservation,
            schema_known,
            older_than_inbox_retention: row.first_seen < chrono::Utc::now() - retention,
        });
    }
    Ok(out)
}

/// The schema version of a dead letter: its body's `schema_version`, else its property's.
fn schema_version(row: &dlq::ReplayRow) -> Option<i64> {
    serde_json::from_slice::<serde_json::Value>(&row.payload)
        .ok()
        .and_then(|v| v.get("schema_version").and_then(serde_json::Value::as_i64))
        .or_else(|| {
            row.properties
                .get("schema_version")
                .and_then(serde_json::Value::as_str)
                .and_then(|v| v.parse().ok())
        })
}

fn print_checks(checks: &[Checks], json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(checks)?);
        return Ok(());
    }
    println!(
        "{:>6}  {:<40}  {:<24}  {:<12}  {:<7}  retention",
        "id", "group / message_id", "already applied", "reservation", "schema"
    );
    for c in checks {
        println!(
            "{:>6}  {:<40}  {:<24}  {:<12}  {:<7}  {}",
            c.dlq_id,
            format!(
                "{} / {}",
                c.consumer_group,
                c.message_id.as_deref().unwrap_or("-")
            ),
            c.already_applied.as_deref().unwrap_or("no"),
            c.reservation.as_deref().unwrap_or("-"),
            if c.schema_known { "known" } else { "UNKNOWN" },
            if c.older_than_inbox_retention {
                "OLDER (needs --force)"
            } else {
                "ok"
            }
        );
    }
    println!("dry run: {} dead letter(s), nothing sent", checks.len());
    Ok(())
}

/// How a replay runs.
struct Plan<'a> {
    actor: &'a str,
    reason: &'a str,
    rate: f64,
    force: bool,
    /// How long to watch the inbox for the effects.
    verify: Duration,
}

/// What a replay came to.
#[derive(Debug, Default)]
struct Done {
    confirmed: usize,
    refused: usize,
    failed: usize,
    applied: usize,
    duplicate: usize,
    not_observed: usize,
}

/// Replays `rows` at most `rate` per second, then watches the inbox for each confirmed
/// replay's effect and records it on its audit row.
async fn replay(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    publisher: &dyn crate::mq::Publisher,
    rows: Vec<(dlq::ReplayRow, Checks)>,
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
    let mut watch: Vec<(String, String, String, bool)> = Vec::new();
    for (row, checks) in rows {
        let replay_id = format!("rpl_{}", ulid::Ulid::new());
        let checks_json = serde_json::to_value(&checks)?;
        let refusal = if checks.older_than_inbox_retention && !plan.force {
            Some((
                "REFUSED_OLDER_THAN_RETENTION",
                format!(
                    "first seen {} is older than the inbox retention ({} days)",
                    row.first_seen, settings.retention.inbox_days
                ),
            ))
        } else if !checks.schema_known && !plan.force {
            Some((
                "REFUSED_SCHEMA_UNKNOWN",
                "its schema version is not one this build reads".to_string(),
            ))
        } else {
            None
        };
        if let Some((outcome, why)) = refusal {
            let audit = dlq::ReplayAudit {
                dlq_id: row.dlq_id,
                actor: plan.actor,
                reason: plan.reason,
                outcome,
                replay_id: &replay_id,
                confirmed: false,
                checks: &checks_json,
            };
            dlq::record_replay(client, &audit).await?;
            bar.println(format!(
                "dead letter {}: refused, {why}; use --force",
                row.dlq_id
            ));
            done.refused += 1;
            bar.inc(1);
            continue;
        }
        let outcome = publisher
            .send(
                replay_message(&row, &replay_id),
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
        let audit = dlq::ReplayAudit {
            dlq_id: row.dlq_id,
            actor: plan.actor,
            reason: plan.reason,
            outcome: &label,
            replay_id: &replay_id,
            confirmed,
            checks: &checks_json,
        };
        dlq::record_replay(client, &audit).await?;
        tracing::info!(dlq_id = row.dlq_id, consumer_group = %row.consumer_group, topic = %row.topic,
                       message_id = row.message_id.as_deref().unwrap_or(""),
                       reservation_id = row.reservation_id.as_deref().unwrap_or(""),
                       order_id = row.order_id.as_deref().unwrap_or(""), replay_id = %replay_id,
                       previous_status = %row.status, outcome = %label,
                       already_applied = checks.already_applied.as_deref().unwrap_or(""),
                       "dead letter replayed");
        if confirmed {
            done.confirmed += 1;
            if let Some(id) = row.message_id.clone() {
                watch.push((
                    replay_id,
                    row.consumer_group.clone(),
                    id,
                    checks.already_applied.is_some(),
                ));
            }
        } else {
            done.failed += 1;
        }
        bar.inc(1);
        tokio::time::sleep(pause).await;
    }
    bar.finish_with_message("sent; watching the inbox");
    observe_effects(client, watch, plan.verify, &mut done).await?;
    Ok(done)
}

/// Watches the groups' inbox until every replayed message shows up or `verify` passes, and
/// records each effect: `APPLIED:<decision>` (the replay was processed), `DUPLICATE` (the inbox
/// already held it: a no-op) or `NOT_OBSERVED` (not processed within the window).
async fn observe_effects(
    client: &tokio_postgres::Client,
    mut watch: Vec<(String, String, String, bool)>,
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
                dlq::inbox_state(client, &group, &message_id)
                    .await?
                    .filter(|(status, _)| status != "PROCESSING")
                    .map(|(_, decision)| format!("APPLIED:{}", decision.unwrap_or_default()))
            };
            match effect {
                Some(effect) => {
                    if before {
                        done.duplicate += 1;
                    } else {
                        done.applied += 1;
                    }
                    dlq::record_replay_effect(client, &replay_id, &effect).await?;
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
        dlq::record_replay_effect(client, replay_id, "NOT_OBSERVED").await?;
        done.not_observed += 1;
    }
    Ok(())
}
