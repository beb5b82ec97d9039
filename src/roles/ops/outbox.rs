//! `seckill outbox requeue`: DEAD outbox rows back to PENDING, with an audit row
//! (docs/architecture/security.md#admin-surface). The same as the admin listener's
//! `POST /admin/v1/outbox/requeue`, for an operator on the host.

use clap::{Args, Subcommand};
use serde_json::json;

use crate::config::Settings;
use crate::pg::{audit, outbox};

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// DEAD rows back to PENDING (fresh attempt count); the relay sends them again.
    Requeue(RequeueArgs),
}

#[derive(Debug, Args)]
pub struct RequeueArgs {
    /// These DEAD rows (repeatable)...
    #[arg(
        long = "event-id",
        conflicts_with = "all_dead",
        required_unless_present = "all_dead"
    )]
    pub event_ids: Vec<String>,
    /// ...or every DEAD row.
    #[arg(long)]
    pub all_dead: bool,
}

/// Requeues and audits in one transaction; prints each requeued event id.
pub async fn run(settings: Settings, command: OutboxCommand) -> anyhow::Result<bool> {
    let OutboxCommand::Requeue(args) = command;
    let pool = crate::pg::connect_pool(&settings.pg, 1).await?;
    let mut client = pool.get().await?;
    let c: &mut tokio_postgres::Client = &mut client;
    let tx = c.transaction().await?;
    let ids = (!args.all_dead).then_some(args.event_ids.as_slice());
    let requeued = outbox::requeue_dead(&tx, ids).await?;
    let actor = audit::cli_actor();
    audit::record(
        &tx,
        &actor,
        "outbox_requeue",
        "event_outbox",
        &json!({"requeued": requeued}),
    )
    .await?;
    tx.commit().await?;
    for id in &requeued {
        println!("{id}");
    }
    eprintln!("{} DEAD outbox row(s) back to PENDING", requeued.len());
    Ok(true)
}
