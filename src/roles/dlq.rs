//! Dead letters: the intake consumer (inside `seckill consume`) that records every message a
//! group gave up on, and the operator's `seckill dlq list | show | discard`.

use std::time::Duration;

use clap::Subcommand;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::config::Settings;
use crate::mq::{BatchHandler, ConsumeDecision, Delivery};
use crate::pg::dlq;

/// Records the dead letters of one group.
pub struct DlqIntake {
    pub pool: deadpool_postgres::Pool,
    /// The group whose `%DLQ%` topic this consumes.
    pub source_group: String,
    /// The topic that group consumes (the dead letters' original topic).
    pub source_topic: String,
}

#[async_trait::async_trait]
impl BatchHandler for DlqIntake {
    async fn handle(&self, batch: Vec<Delivery>) -> ConsumeDecision {
        let client = match self.pool.get().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "DLQ intake cannot reach PostgreSQL; will be redelivered");
                return ConsumeDecision::Retry;
            }
        };
        for d in &batch {
            match dlq::intake(&**client, &self.source_group, &self.source_topic, d).await {
                Ok(true) => {
                    metrics::counter!("mq_dlq_intake_total").increment(1);
                    error!(
                        consumer_group = %self.source_group, topic = %self.source_topic,
                        message_id = d.properties.get("message_id").map(String::as_str).unwrap_or(""),
                        reservation_id = d.properties.get("reservation_id").map(String::as_str).unwrap_or(""),
                        order_id = d.properties.get("order_id").map(String::as_str).unwrap_or(""),
                        "message dead-lettered after its last retry; recorded for an operator"
                    );
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %e, "DLQ intake failed; will be redelivered");
                    return ConsumeDecision::Retry;
                }
            }
        }
        ConsumeDecision::Ack
    }
}

/// Starts one intake consumer per group with dead letters.
pub async fn start_intakes(
    settings: &Settings,
    pool: deadpool_postgres::Pool,
) -> anyhow::Result<Vec<crate::mq::rocketmq::ConsumerHandle>> {
    let names = settings.names();
    let mut handles = Vec::new();
    for (group, topic) in names.dead_letter_sources() {
        let intake = std::sync::Arc::new(DlqIntake {
            pool: pool.clone(),
            source_group: group.clone(),
            source_topic: topic,
        });
        // One intake group over all DLQ topics would mix subscriptions; one group per source.
        let intake_group = format!("{}_{}", names.dlq_intake_group, short(&group));
        handles.push(
            crate::mq::start_consumer(
                settings,
                &intake_group,
                &crate::config::Names::dlq_topic(&group),
                intake,
                1,
                16,
            )
            .await?,
        );
    }
    Ok(handles)
}

/// A short, stable suffix for a group name (its purpose part).
fn short(group: &str) -> &'static str {
    if group.contains("ORDER_CREATE") {
        "ORDER_CREATE"
    } else if group.contains("COMPENSATE") {
        "COMPENSATE"
    } else if group.contains("TIMEOUT") {
        "TIMEOUT"
    } else {
        "PROJECTION"
    }
}

/// Keeps `mq_dlq_messages` and `mq_dlq_oldest_age_seconds` current until `shutdown`.
pub async fn run_gauges(pool: deadpool_postgres::Pool, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        if let Ok(client) = pool.get().await {
            if let Ok((open, oldest)) = dlq::open_stats(&**client).await {
                metrics::gauge!("mq_dlq_messages").set(open as f64);
                metrics::gauge!("mq_dlq_oldest_age_seconds").set(oldest);
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(5)) => {}
        }
    }
}

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
    let cfg = crate::pg::pg_config(&settings.pg)?;
    let (mut client, conn) = cfg.connect(tokio_postgres::NoTls).await?;
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
