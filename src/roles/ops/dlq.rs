//! `seckill dlq list | show | replay | discard`: the operator's side of the dead letters that
//! the intake (in `seckill consume`, `roles::consume::dlq_intake`) recorded in PostgreSQL.

use std::time::Duration;

use clap::Subcommand;

use crate::config::Settings;
use crate::pg::dlq;

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
        /// Why (kept in the audit).
        #[arg(long)]
        reason: String,
        #[arg(long)]
        actor: Option<String>,
        /// Messages per second at most.
        #[arg(long, default_value_t = 20.0)]
        rate: f64,
        /// Replay even what is older than the inbox retention (it may apply twice).
        #[arg(long)]
        force: bool,
    },
    /// Give up on a dead letter (audited).
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
        } => {
            anyhow::ensure!(!reason.trim().is_empty(), "--reason must say why");
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
            let publisher = crate::mq::connect_publisher(&settings).await?;
            let (ok, refused, failed) = replay(
                &settings,
                &mut client,
                publisher.as_ref(),
                rows,
                &actor,
                &reason,
                rate,
                force,
            )
            .await?;
            println!(
                "replay: {ok} confirmed, {refused} refused (older than the inbox retention), {failed} failed"
            );
            failed == 0 && refused == 0
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
            if dlq::discard(&mut client, dlq_id, &actor, &reason).await? {
                println!("dead letter {dlq_id} discarded by {actor}: {reason}");
                true
            } else {
                eprintln!("dead letter {dlq_id} is not OPEN (or does not exist)");
                false
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

/// Replays `rows` at most `rate` per second; returns (confirmed, refused, failed).
#[allow(clippy::too_many_arguments)]
async fn replay(
    settings: &Settings,
    client: &mut tokio_postgres::Client,
    publisher: &dyn crate::mq::Publisher,
    rows: Vec<dlq::ReplayRow>,
    actor: &str,
    reason: &str,
    rate: f64,
    force: bool,
) -> anyhow::Result<(usize, usize, usize)> {
    let retention = chrono::Duration::from_std(crate::config::RetentionSettings::age(
        settings.retention.inbox_days,
    ))?;
    let bar = indicatif::ProgressBar::new(rows.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let pause = Duration::from_secs_f64(1.0 / rate);
    let (mut ok, mut refused, mut failed) = (0, 0, 0);
    for row in rows {
        let replay_id = format!("rpl_{}", ulid::Ulid::new());
        if row.first_seen < chrono::Utc::now() - retention && !force {
            dlq::record_replay(
                client,
                row.dlq_id,
                actor,
                reason,
                "REFUSED_OLDER_THAN_RETENTION",
                &replay_id,
                false,
            )
            .await?;
            bar.println(format!(
                "dead letter {}: refused, first seen {} is older than the inbox retention ({} days); use --force",
                row.dlq_id, row.first_seen, settings.retention.inbox_days
            ));
            refused += 1;
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
        let label = if force && row.first_seen < chrono::Utc::now() - retention {
            format!("{}_FORCED", outcome.label().to_uppercase())
        } else {
            outcome.label().to_uppercase()
        };
        dlq::record_replay(
            client, row.dlq_id, actor, reason, &label, &replay_id, confirmed,
        )
        .await?;
        tracing::info!(dlq_id = row.dlq_id, consumer_group = %row.consumer_group, topic = %row.topic,
                       message_id = row.message_id.as_deref().unwrap_or(""),
                       reservation_id = row.reservation_id.as_deref().unwrap_or(""),
                       order_id = row.order_id.as_deref().unwrap_or(""), replay_id = %replay_id,
                       previous_status = %row.status, outcome = %label, "dead letter replayed");
        if confirmed {
            ok += 1;
        } else {
            failed += 1;
        }
        bar.inc(1);
        tokio::time::sleep(pause).await;
    }
    bar.finish_with_message("done");
    Ok((ok, refused, failed))
}
