//! `seckill refunds`: the refunds the shop owes (docs/architecture/recovery.md#refund-obligations).
//! `list` shows them oldest first; `mark-refunded` records the provider's refund id once the
//! money went back (audited, idempotent). The same as the admin listener's
//! `/admin/v1/refunds` routes, for an operator on the host.

use crate::domain::status::RefundStatus;
use clap::{Args, Subcommand};

use crate::config::Settings;
use crate::pg::{audit, refunds};

#[derive(Debug, Subcommand)]
pub enum RefundsCommand {
    /// Refunds owed (PENDING), oldest first; `--all` adds those already refunded.
    List(ListArgs),
    /// Record that a payment was refunded (by the provider's refund id); repeating it changes
    /// nothing.
    MarkRefunded(MarkArgs),
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Every obligation, REFUNDED ones too.
    #[arg(long)]
    pub all: bool,
    #[arg(long, default_value_t = 1000)]
    pub limit: i64,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct MarkArgs {
    /// The payment owed back.
    #[arg(long)]
    pub payment_id: String,
    /// The provider's refund id (or where the refund is recorded).
    #[arg(long)]
    pub reference: String,
}

/// Runs one refunds command; `Ok(false)` when a mark names no obligation.
pub async fn run(settings: Settings, command: RefundsCommand) -> anyhow::Result<bool> {
    let pool = crate::pg::connect_pool(&settings.pg, 1).await?;
    let mut client = pool.get().await?;
    match command {
        RefundsCommand::List(a) => {
            let rows = refunds::list(&**client, !a.all, a.limit.max(1)).await?;
            print_list(&rows, a.json)?;
            Ok(true)
        }
        RefundsCommand::MarkRefunded(a) => {
            anyhow::ensure!(
                refunds::valid_reference(&a.reference),
                "--reference must be 1-128 printable characters"
            );
            let c: &mut tokio_postgres::Client = &mut client;
            // As the admin route: a mark a failover could lose is not made (it would show the
            // refund as owed again).
            anyhow::ensure!(
                !settings.payments.require_sync_standby
                    || crate::pg::primary::has_sync_standby(&*c).await?,
                "the primary has no synchronous standby (payments.require_sync_standby): the mark \
                 would not survive a failover; nothing recorded, run it again once the standby is \
                 back"
            );
            let marked =
                refunds::mark_refunded_audited(c, &a.payment_id, &a.reference, &audit::cli_actor())
                    .await?;
            Ok(match marked {
                refunds::Marked::Refunded(o) => {
                    println!("{}", serde_json::to_string(&o)?);
                    eprintln!(
                        "refund of {} cents for payment {} marked REFUNDED",
                        o.amount_cents, o.payment_id
                    );
                    true
                }
                refunds::Marked::Already(o) => {
                    println!("{}", serde_json::to_string(&o)?);
                    eprintln!(
                        "payment {} was already marked REFUNDED ({}); nothing changed",
                        o.payment_id,
                        o.refund_reference.as_deref().unwrap_or("-")
                    );
                    true
                }
                refunds::Marked::NotFound => {
                    eprintln!("no refund obligation for payment {}", a.payment_id);
                    false
                }
            })
        }
    }
}

fn print_list(rows: &[refunds::Obligation], json: bool) -> anyhow::Result<()> {
    if json {
        for o in rows {
            println!("{}", serde_json::to_string(o)?);
        }
        return Ok(());
    }
    println!(
        "{:<28} {:<28} {:>12} {:<16} {:<9} {:<20}",
        "payment_id", "order_id", "amount_cents", "reason", "status", "created_at"
    );
    for o in rows {
        println!(
            "{:<28} {:<28} {:>12} {:<16} {:<9} {:<20}",
            o.payment_id,
            o.order_id,
            o.amount_cents,
            o.reason,
            o.status,
            o.created_at.format("%Y-%m-%dT%H:%M:%SZ")
        );
    }
    let owed: i64 = rows
        .iter()
        .filter(|o| o.status == RefundStatus::Pending.as_str())
        .map(|o| o.amount_cents)
        .sum();
    eprintln!("{} obligation(s); {owed} cents owed among them", rows.len());
    Ok(())
}
