//! A running replay an operator controls (docs/RUNBOOK.md#dead-letters): `--activity` narrows
//! what is replayed to one sale, `--pause <batch>` stops the running command before its next
//! message and `--resume <batch>` lets it go on where it stopped; the command's progress is in
//! `replay_batches` as it goes.

use std::time::Duration;

use crate::domain::status::ReplayBatchStatus;
use crate::pg::replay::ReplayRow;
use crate::pg::replay_batches;

/// How often a paused command looks whether it was resumed.
const PAUSED_POLL: Duration = Duration::from_millis(250);

/// The activity a selected message belongs to: its body's `activity_id`, else the one its
/// reservation id names.
pub(super) fn activity_of(row: &ReplayRow) -> Option<i64> {
    serde_json::from_slice::<serde_json::Value>(&row.payload)
        .ok()
        .and_then(|v| v.get("activity_id").and_then(serde_json::Value::as_i64))
        .or_else(|| {
            row.reservation_id
                .as_deref()
                .and_then(crate::domain::ids::reservation_activity)
        })
}

/// `--pause <batch>` (`pause`) or `--resume <batch>`: flips the batch, audited; `false` when
/// it was not running (not paused), with what it is.
pub(super) async fn control(
    client: &tokio_postgres::Client,
    batch_id: &str,
    pause: bool,
    actor: &str,
) -> anyhow::Result<bool> {
    use ReplayBatchStatus::{Paused, Running};
    let (from, to, action) = if pause {
        (Running, Paused, "replay_pause")
    } else {
        (Paused, Running, "replay_resume")
    };
    let moved = replay_batches::set(client, batch_id, from, to).await?;
    let now = replay_batches::get(client, batch_id).await?;
    let detail = serde_json::json!({
        "moved": moved,
        "status": now.as_ref().map(|b| b.status.as_str()),
        "sent": now.as_ref().map(|b| b.sent),
        "total": now.as_ref().map(|b| b.total),
    });
    crate::pg::audit::record(client, actor, action, batch_id, &detail).await?;
    match (moved, now) {
        (true, Some(b)) => println!(
            "replay {batch_id}: {} at {}/{} sent",
            to.as_str(),
            b.sent,
            b.total
        ),
        (false, Some(b)) => eprintln!(
            "replay {batch_id} is {}, not {}: nothing changed",
            b.status.as_str(),
            from.as_str()
        ),
        (_, None) => eprintln!("no replay batch {batch_id}"),
    }
    Ok(moved)
}

/// The running command's side of a batch: its progress written as it goes, and a stop before
/// each message while an operator holds it paused.
pub(super) struct Gate<'a> {
    pub(super) batch_id: &'a str,
    pub(super) sent: std::sync::atomic::AtomicUsize,
}

impl Gate<'_> {
    /// Waits while the batch is paused (noting once that it held), then returns.
    pub(super) async fn pass(
        &self,
        client: &tokio_postgres::Client,
        bar: &indicatif::ProgressBar,
    ) -> anyhow::Result<()> {
        let mut noted = false;
        loop {
            let status = replay_batches::get(client, self.batch_id)
                .await?
                .map(|b| b.status);
            if status != Some(ReplayBatchStatus::Paused) {
                if noted {
                    bar.set_message("resumed");
                }
                return Ok(());
            }
            if !noted {
                replay_batches::held(client, self.batch_id).await?;
                bar.set_message(format!(
                    "paused (seckill dlq replay --resume {})",
                    self.batch_id
                ));
                noted = true;
            }
            tokio::time::sleep(PAUSED_POLL).await;
        }
    }

    /// One more message sent.
    pub(super) async fn sent_one(&self, client: &tokio_postgres::Client) -> anyhow::Result<()> {
        let sent = self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        replay_batches::progress(client, self.batch_id, sent).await?;
        Ok(())
    }
}
