//! Tables partitioned by day (`<table>_pYYYYMMDD`, one per UTC day of the partition key): each
//! day's partition made when the first row of that day arrives.

use chrono::{NaiveDate, NaiveTime, Utc};

use crate::archive::Archive;
use crate::pg::retention::RetentionError;

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

/// Archives and drops `table`'s day partitions that lie wholly before `now() - age`: each is
/// first detached and renamed `<partition>_archiving` (a late row of that day makes a fresh
/// partition, never lands in one being archived), then read in segments of `segment_rows`, each
/// written to the archive and catalogued, and dropped in the same transaction. A partition left
/// detached by a pass that stopped is finished by the next. Returns the rows archived.
pub async fn shed_days(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    table: &'static str,
    time_column: &'static str,
    age: std::time::Duration,
    segment_rows: i64,
) -> Result<u64, RetentionError> {
    let cutoff = Utc::now() - chrono::Duration::from_std(age).unwrap_or(chrono::Duration::MAX);
    for day in days(&*client, table).await? {
        let upper = day
            .succ_opt()
            .unwrap_or(day)
            .and_time(NaiveTime::MIN)
            .and_utc();
        if upper > cutoff {
            continue;
        }
        let name = partition_name(table, day);
        let tx = client.transaction().await?;
        tx.batch_execute(&format!(
            "ALTER TABLE {table} DETACH PARTITION {name};
             ALTER TABLE {name} RENAME TO {name}_archiving"
        ))
        .await?;
        tx.commit().await?;
    }
    let schema_version = crate::pg::archive_segments::schema_version(&*client).await?;
    let mut rows = 0;
    for detached in archiving(&*client, table).await? {
        let tx = client.transaction().await?;
        tx.batch_execute(&format!(
            "DECLARE shed NO SCROLL CURSOR FOR SELECT to_jsonb(d), d.{time_column} FROM {detached} d"
        ))
        .await?;
        loop {
            let chunk = tx
                .query(&format!("FETCH {segment_rows} FROM shed"), &[])
                .await?;
            if chunk.is_empty() {
                break;
            }
            let segment = crate::archive::Batch {
                table: table.to_string(),
                time_column: time_column.to_string(),
                source: format!("DROP {}", detached.trim_end_matches("_archiving")),
                schema_version,
                rows: chunk.iter().map(|r| (r.get(0), r.get(1))).collect(),
            };
            let manifest = archive.write_async(segment).await?;
            crate::pg::archive_segments::insert(&tx, &manifest).await?;
            crate::pg::retention::archived(&manifest);
            rows += manifest.rows;
        }
        tx.batch_execute(&format!("CLOSE shed; DROP TABLE {detached}"))
            .await?;
        tx.commit().await?;
        metrics::counter!("retention_partitions_dropped_total", "table" => table).increment(1);
    }
    Ok(rows)
}

fn partition_name(table: &str, day: NaiveDate) -> String {
    format!("{table}_p{}", day.format("%Y%m%d"))
}

/// The days of `table`'s attached partitions, in this schema.
async fn days(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<Vec<NaiveDate>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT c.relname FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid
               JOIN pg_class p ON p.oid = i.inhparent
               JOIN pg_namespace n ON n.oid = p.relnamespace
             WHERE p.relname = $1 AND n.nspname = current_schema()
             ORDER BY c.relname",
            &[&table],
        )
        .await?;
    let prefix = format!("{table}_p");
    Ok(rows
        .iter()
        .filter_map(|r| {
            let name: String = r.get(0);
            NaiveDate::parse_from_str(name.strip_prefix(&prefix)?, "%Y%m%d").ok()
        })
        .collect())
}

/// `table`'s partitions detached for archiving and not yet dropped, in this schema.
async fn archiving(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT tablename FROM pg_tables
             WHERE schemaname = current_schema() AND tablename LIKE $1 ORDER BY tablename",
            &[&format!("{table}\\_p%\\_archiving")],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}
