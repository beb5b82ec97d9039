//! Tables partitioned by day (`<table>_pYYYYMMDD`, one per UTC day of the partition key): the
//! audit record's made when the first row of that day arrives, the inbox's and the outbox's ahead
//! by each retention pass (`pg::retention`).

use chrono::NaiveDate;

/// Makes `table`'s partition of `day` unless it exists. Two writers making the same day at once
/// both succeed: the one that loses the race finds it made.
pub async fn ensure_day(
    client: &tokio_postgres::Client,
    table: &str,
    day: NaiveDate,
) -> Result<(), tokio_postgres::Error> {
    let next = day.succ_opt().unwrap_or(day);
    let sql = format!(
        "CREATE TABLE IF NOT EXISTS {} PARTITION OF {table}
         FOR VALUES FROM ('{day} 00:00:00+00') TO ('{next} 00:00:00+00')",
        partition_name(table, day)
    );
    match client.batch_execute(&sql).await {
        Ok(()) => Ok(()),
        // The same name made by another writer between our check and our create.
        Err(e)
            if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_TABLE)
                || e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// `<table>_pYYYYMMDD`: the name of `table`'s partition of `day`.
pub fn partition_name(table: &str, day: NaiveDate) -> String {
    format!("{table}_p{}", day.format("%Y%m%d"))
}
