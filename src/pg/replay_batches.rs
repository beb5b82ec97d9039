//! `replay_batches`: how far an operator's running replay got, and whether it may go on
//! (docs/RUNBOOK.md#dead-letters). The running `seckill dlq replay` writes its progress; an
//! operator's `--pause` / `--resume` flips its status, and the command obeys before each message.

use tokio_postgres::GenericClient;

use crate::domain::status::ReplayBatchStatus;

/// A batch as the table holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub status: ReplayBatchStatus,
    pub sent: i32,
    pub total: i32,
}

/// Records a new batch of `total` messages, RUNNING.
pub async fn start(
    client: &impl GenericClient,
    batch_id: &str,
    total: usize,
    actor: &str,
    reason: &str,
) -> Result<(), tokio_postgres::Error> {
    let total = i32::try_from(total).unwrap_or(i32::MAX);
    client
        .execute(
            "INSERT INTO replay_batches (batch_id, status, total, actor, reason)
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &batch_id,
                &ReplayBatchStatus::Running.as_str(),
                &total,
                &actor,
                &reason,
            ],
        )
        .await
        .map(|_| ())
}

/// The batch, or `None` when no batch has that id.
pub async fn get(
    client: &impl GenericClient,
    batch_id: &str,
) -> Result<Option<Batch>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "SELECT status, sent, total FROM replay_batches WHERE batch_id = $1",
            &[&batch_id],
        )
        .await?;
    Ok(row.map(|r| Batch {
        status: r
            .get::<_, String>(0)
            .parse()
            .unwrap_or(ReplayBatchStatus::Done),
        sent: r.get(1),
        total: r.get(2),
    }))
}

/// Records `sent` messages sent so far.
pub async fn progress(
    client: &impl GenericClient,
    batch_id: &str,
    sent: usize,
) -> Result<(), tokio_postgres::Error> {
    let sent = i32::try_from(sent).unwrap_or(i32::MAX);
    client
        .execute(
            "UPDATE replay_batches SET sent = $2, updated_at = now() WHERE batch_id = $1",
            &[&batch_id, &sent],
        )
        .await
        .map(|_| ())
}

/// The running command notes that it stopped for a pause.
pub async fn held(
    client: &impl GenericClient,
    batch_id: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "UPDATE replay_batches SET held_at = now(), updated_at = now() WHERE batch_id = $1",
            &[&batch_id],
        )
        .await
        .map(|_| ())
}

/// Moves the batch from `from` to `to`; `false` when it was not in `from` (or is unknown).
pub async fn set(
    client: &impl GenericClient,
    batch_id: &str,
    from: ReplayBatchStatus,
    to: ReplayBatchStatus,
) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            "UPDATE replay_batches SET status = $3, updated_at = now()
             WHERE batch_id = $1 AND status = $2",
            &[&batch_id, &from.as_str(), &to.as_str()],
        )
        .await?;
    Ok(n == 1)
}
