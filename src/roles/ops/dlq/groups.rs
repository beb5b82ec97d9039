//! `seckill dlq groups`: the open dead letters and the quarantined messages as a work queue,
//! grouped by what failed rather than listed one by one. A group's fingerprint is its source
//! (dead letter or quarantine), consumer group, error class (or quarantine reason), error
//! message with its ids and numbers normalised away, and the body's `schema_version`; each
//! group shows its count, first and last arrival and a few sample ids to `dlq show` before
//! deciding what to do with the rest.

pub use crate::services::failure_groups::{
    by_fingerprint, failure_groups, normalise, FailureGroup,
};

/// `seckill dlq groups`. False when there is nothing open.
pub async fn print(
    client: &tokio_postgres::Client,
    consumer_group: Option<&str>,
    limit: i64,
    json: bool,
) -> anyhow::Result<bool> {
    let groups = failure_groups(client, consumer_group, limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&groups)?);
        return Ok(!groups.is_empty());
    }
    println!(
        "{:<12}  {:<11}  {:>6}  {:<20}  {:<36}  {:<18}  {:>6}  samples  message",
        "fingerprint", "source", "count", "last seen", "consumer group", "class", "schema"
    );
    for g in &groups {
        let samples: Vec<String> = g.samples.iter().map(i64::to_string).collect();
        println!(
            "{:<12}  {:<11}  {:>6}  {:<20}  {:<36}  {:<18}  {:>6}  {:<7}  {}",
            g.fingerprint,
            g.source,
            g.count,
            g.last_seen.format("%Y-%m-%d %H:%M:%S").to_string(),
            g.consumer_group,
            g.class,
            g.schema_version
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            samples.join(","),
            g.message
        );
    }
    Ok(!groups.is_empty())
}
