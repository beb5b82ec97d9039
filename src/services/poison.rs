//! What every consumer group does with a body it cannot read, and with a batch that failed:
//! the body is quarantined with its raw bytes and acknowledged (it would fail every retry);
//! a batch that failed for any other reason is redelivered by the broker (every step is
//! idempotent). docs/architecture/order-creation.md#error-classes.

use serde::de::DeserializeOwned;
use tokio_postgres::GenericClient;
use tracing::warn;

use crate::mq::{ConsumeDecision, Delivery};

/// Quarantines one unreadable message (`INVALID_EVENT`, with why), counted and logged.
pub async fn quarantine(
    client: &impl GenericClient,
    group: &str,
    d: &Delivery,
    why: &str,
) -> Result<(), tokio_postgres::Error> {
    crate::pg::quarantine(client, group, d, "INVALID_EVENT", why).await?;
    metrics::counter!("mq_quarantine_total", "reason" => "INVALID_EVENT").increment(1);
    warn!(consumer_group = group, broker_msg_id = %d.broker_msg_id, error = why,
          "poison message quarantined with its raw body");
    Ok(())
}

/// Decodes each body as `T`; those that do not decode are quarantined. The rest come back
/// with their place in the batch.
pub async fn decode_each<T: DeserializeOwned>(
    pool: &deadpool_postgres::Pool,
    group: &str,
    batch: &[Delivery],
) -> anyhow::Result<Vec<(usize, T)>> {
    let mut good = Vec::with_capacity(batch.len());
    // One connection for the batch's poison, taken only if there is any.
    let mut client = None;
    for (i, d) in batch.iter().enumerate() {
        match serde_json::from_slice::<T>(&d.body) {
            Ok(v) => good.push((i, v)),
            Err(e) => {
                if client.is_none() {
                    client = Some(pool.get().await?);
                }
                if let Some(c) = &client {
                    quarantine(&***c, group, d, &e.to_string()).await?;
                }
            }
        }
    }
    Ok(good)
}

/// ACK a batch that was processed; have the broker redeliver one that failed.
pub fn ack_or_retry<T, E: std::fmt::Display>(
    result: Result<T, E>,
    what: &'static str,
    batch: usize,
) -> ConsumeDecision {
    match result {
        Ok(_) => ConsumeDecision::Ack,
        Err(e) => {
            warn!(error = %e, batch, consumer = what, "batch failed; will be redelivered");
            ConsumeDecision::Retry
        }
    }
}
