//! Retention: bookkeeping rows past their retention are deleted in bounded batches, each
//! batch its own short autocommit statement, so the hot tables are never locked for long.
//! Only settled rows go: SENT outbox rows, REPLAYED/DISCARDED dead letters; PENDING and DEAD
//! outbox rows and OPEN dead letters stay until someone deals with them; the DLQ audit trail
//! is never purged.

use std::time::Duration;

use chrono::{NaiveDate, NaiveTime, Utc};

use crate::archive::{self, Archive};

/// One table's rule: which rows are old enough to go.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub table: &'static str,
    /// Column holding the row's age.
    pub time_column: &'static str,
    /// Extra condition: only settled rows.
    pub only: &'static str,
}

pub const INBOX: Rule = Rule {
    table: "consumer_inbox_by_day",
    time_column: "received_at",
    only: "true",
};
pub const FAILURES: Rule = Rule {
    table: "consumer_failures",
    time_column: "updated_at",
    only: "true",
};
pub const OUTBOX: Rule = Rule {
    table: "event_outbox_by_day",
    time_column: "created_at",
    only: "status = 'SENT'",
};
pub const QUARANTINE: Rule = Rule {
    table: "quarantined_messages",
    time_column: "received_at",
    only: "true",
};
pub const DLQ: Rule = Rule {
    table: "dlq_messages",
    time_column: "first_seen",
    only: "status IN ('REPLAYED', 'DISCARDED')",
};

/// A table's retention mark only moves forward: how far its rows may be gone.
const MARK_ONLY_FORWARD: &str = "ON CONFLICT (table_name) DO UPDATE
    SET purged_before = GREATEST(retention_marks.purged_before, EXCLUDED.purged_before),
        updated_at = now()";

/// Why a retention pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Pg(#[from] tokio_postgres::Error),
    /// The archive could not be written: nothing was deleted.
    #[error("archive: {0}")]
    Archive(#[from] std::io::Error),
}

/// Moves rows of `rule` older than `age` into the archive, `batch` at a time; returns
/// (rows, batches). Each batch is one transaction: the rows' DELETE, their segment written and
/// synced, its catalogue row, then COMMIT; a segment that cannot be written rolls its DELETE
/// back (docs/architecture/postgresql.md#the-archive).
pub async fn purge(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    rule: Rule,
    age: Duration,
    batch: i64,
) -> Result<(u64, u64), RetentionError> {
    // The mark first: from now on a reader must expect rows older than the cutoff to be gone.
    client
        .execute(
            &format!(
                "INSERT INTO retention_marks (table_name, purged_before)
                 VALUES ($1, now() - make_interval(secs => $2)) {MARK_ONLY_FORWARD}"
            ),
            &[&rule.table, &age.as_secs_f64()],
        )
        .await?;
    let schema_version = crate::pg::archive_segments::schema_version(&*client).await?;
    let (mut rows, mut batches) = (0u64, 0u64);
    for leaf in leaves(&*client, rule.table).await? {
        let (r, b) = purge_leaf(client, archive, rule, &leaf, age, batch, schema_version).await?;
        rows += r;
        batches += b;
    }
    Ok((rows, batches))
}

/// [`purge`] on one table that holds rows: `rule.table` itself, or one of its partitions. The
/// rows of a batch are found and deleted by their `ctid` in that table, a TID scan whatever the
/// statistics say; the same statement on a partitioned table joins `(tableoid, ctid)` across
/// every partition, planned per partition. Neither kept up with make soak's 5-minute retention
/// at 300 orders/s on this machine (660-900 rows archived a second during the sale, 1,100
/// written): docs/benchmarks-history.md#the-inbox-and-the-outbox-by-day-2026-12-07.
async fn purge_leaf(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    rule: Rule,
    leaf: &str,
    age: Duration,
    batch: i64,
    schema_version: i32,
) -> Result<(u64, u64), RetentionError> {
    let sql = format!(
        "DELETE FROM {leaf} AS d WHERE ctid = ANY(ARRAY(
            SELECT t.ctid FROM {leaf} t
            WHERE t.{col} < now() - make_interval(secs => $1) AND ({only})
            LIMIT $2))
         RETURNING to_jsonb(d), d.{col}",
        col = rule.time_column,
        only = rule.only,
    );
    let (mut rows, mut batches) = (0u64, 0u64);
    loop {
        let tx = client.transaction().await?;
        let deleted = tx.query(&sql, &[&age.as_secs_f64(), &batch]).await?;
        let n = deleted.len() as u64;
        if n == 0 {
            break;
        }
        let segment = archive::Batch {
            table: rule.table.to_string(),
            time_column: rule.time_column.to_string(),
            source: "DELETE".to_string(),
            schema_version,
            rows: deleted.iter().map(|r| (r.get(0), r.get(1))).collect(),
        };
        // An error here drops `tx`: the rows stay.
        let manifest = archive.write_async(segment).await?;
        crate::pg::archive_segments::insert(&tx, &manifest).await?;
        tx.commit().await?;
        archived(&manifest);
        rows += n;
        batches += 1;
        if n < batch as u64 {
            break;
        }
    }
    Ok((rows, batches))
}

/// The tables that hold `table`'s rows: its partitions, or itself when it has none.
async fn leaves(
    client: &tokio_postgres::Client,
    table: &str,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT t.relid::regclass::text FROM pg_partition_tree(to_regclass($1)) t
             WHERE t.isleaf
             UNION ALL
             SELECT c.oid::regclass::text FROM pg_class c
             WHERE c.oid = to_regclass($1) AND c.relkind = 'r'
             ORDER BY 1",
            &[&table],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Counts a committed segment on the role's /metrics.
pub fn archived(m: &crate::archive::Manifest) {
    let table = m.table.clone();
    metrics::counter!("archive_segments_total", "table" => table.clone()).increment(1);
    metrics::counter!("archive_rows_total", "table" => table.clone()).increment(m.rows);
    metrics::counter!("archive_bytes_total", "table" => table).increment(m.bytes);
}

/// The audit record: appended, never settled; its day partitions are archived and dropped whole.
pub const AUDIT: Rule = Rule {
    table: "audit_events",
    time_column: "order_at",
    only: "true",
};

/// How long a pass waits for a lock on a hot table (to detach a day or make one ahead) before
/// leaving it to the next pass: a statement queued behind a long transaction would hold every
/// writer of the table behind it.
const LOCK_TIMEOUT_MS: u64 = 2000;

/// The days ahead of today whose partitions each pass makes, so no day starts without one.
const DAYS_AHEAD: u64 = 3;

/// The tables partitioned by day of their rows' ids or times, with their retention.
pub fn by_day(r: &crate::config::RetentionSettings) -> [(Rule, Duration); 3] {
    let days = crate::config::RetentionSettings::age;
    [
        (INBOX, days(r.inbox_days)),
        (OUTBOX, days(r.outbox_days)),
        (AUDIT, days(r.audit_days)),
    ]
}

/// Makes `table`'s partitions for today and the [`DAYS_AHEAD`] days after, except the audit
/// record's (its consumer makes each day as its first row arrives). A day it cannot make now (a
/// lock not granted in time, or rows of that day already in the DEFAULT partition) is logged
/// and left to the next pass; until then its rows land in the DEFAULT partition.
async fn ensure_ahead(
    client: &tokio_postgres::Client,
    table: &'static str,
) -> Result<(), tokio_postgres::Error> {
    if table == AUDIT.table {
        return Ok(());
    }
    let today = Utc::now().date_naive();
    client
        .batch_execute(&format!("SET lock_timeout = '{LOCK_TIMEOUT_MS}ms'"))
        .await?;
    for day in today.iter_days().take(DAYS_AHEAD as usize + 1) {
        if let Err(e) = crate::pg::partitions::ensure_day(client, table, day).await {
            metrics::counter!("retention_partition_create_failures_total", "table" => table)
                .increment(1);
            tracing::warn!(table, %day, error = %crate::pg::errors::classify(e), "day partition not made");
        }
    }
    client.batch_execute("RESET lock_timeout").await
}

/// Every rule with its retention from the settings.
pub fn rules(r: &crate::config::RetentionSettings) -> Vec<(Rule, Duration)> {
    let days = crate::config::RetentionSettings::age;
    vec![
        (INBOX, days(r.inbox_days)),
        (FAILURES, days(r.inbox_days)),
        (OUTBOX, days(r.outbox_days)),
        (QUARANTINE, days(r.quarantine_days)),
        (DLQ, days(r.dlq_days)),
    ]
}

/// The tables the pipeline updates or deletes from all day: where dead rows pile up.
pub const BUSY_TABLES: [&str; 6] = [
    "event_outbox",
    "consumer_inbox",
    "orders",
    "compensation_tasks",
    "reservations",
    "stock_buckets",
];

/// Bound on each statement of a retention pass (a batch DELETE, a VACUUM).
const PASS_STATEMENT_TIMEOUT_SECS: u64 = 600;

/// One retention pass as the scan role runs it: its statements are not the hot path's (a
/// batch DELETE on a big table, or a VACUUM, may take longer than `pg.statement_timeout_ms`; it
/// failed every pass of make soak with the 2 s bound), so the session's bound is raised for the
/// pass and set back to `statement_timeout_ms` after it. On an error the session may still hold
/// the long bound: the caller must not give it back to its pool.
pub async fn pass(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    r: &crate::config::RetentionSettings,
    statement_timeout_ms: u64,
) -> Result<Vec<(&'static str, u64)>, RetentionError> {
    crate::pg::set_statement_timeout(&*client, PASS_STATEMENT_TIMEOUT_SECS).await?;
    let done = purge_all(client, archive, r).await?;
    crate::pg::reset_statement_timeout(&*client, statement_timeout_ms).await?;
    Ok(done)
}

/// One pass over every table; returns the rows archived and deleted per table. With `retention.vacuum`,
/// then `VACUUM (ANALYZE)` of the busy tables, for a database that runs without autovacuum.
pub async fn purge_all(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    r: &crate::config::RetentionSettings,
) -> Result<Vec<(&'static str, u64)>, RetentionError> {
    let mut out = Vec::new();
    // Whole days first; the row rules then take what is left past retention: the DEFAULT
    // partitions' rows, a day's settled rows while it is held, the day the cutoff falls in.
    for (rule, age) in by_day(r) {
        ensure_ahead(client, rule.table).await?;
        let rows = shed_days(client, archive, rule, age, r.archive_segment_rows).await?;
        metrics::counter!("retention_deleted_total", "table" => rule.table).increment(rows);
        out.push((rule.table, rows));
    }
    for (rule, age) in rules(r) {
        let (rows, _) = purge(client, archive, rule, age, r.batch).await?;
        metrics::counter!("retention_deleted_total", "table" => rule.table).increment(rows);
        match out.iter_mut().find(|(t, _)| *t == rule.table) {
            Some((_, n)) => *n += rows,
            None => out.push((rule.table, rows)),
        }
    }
    if r.vacuum {
        for table in BUSY_TABLES {
            // VACUUM runs outside any transaction: one simple-query statement, autocommit.
            client
                .batch_execute(&format!("VACUUM (ANALYZE) {table}"))
                .await?;
        }
    }
    Ok(out)
}

/// Archives and drops the day partitions of `rule.table` that lie wholly before `now() - age`
/// and hold only settled rows (`rule.only`; one that holds others stays attached, and the row
/// rules take its settled rows): each is first detached and renamed `<partition>_archiving` (a
/// late row of that day makes a fresh partition or lands in the DEFAULT one, never in one being
/// archived), then read in segments of `segment_rows`, each written to the archive and
/// catalogued, and dropped in the same transaction, which also moves the table's retention mark
/// past its newest row. A partition left detached by a pass that stopped is finished by the
/// next. Returns the rows archived.
pub async fn shed_days(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    rule: Rule,
    age: std::time::Duration,
    segment_rows: i64,
) -> Result<u64, RetentionError> {
    let cutoff = Utc::now() - chrono::Duration::from_std(age).unwrap_or(chrono::Duration::MAX);
    for day in days(&*client, rule.table).await? {
        let upper = day
            .succ_opt()
            .unwrap_or(day)
            .and_time(NaiveTime::MIN)
            .and_utc();
        if upper <= cutoff {
            detach(client, rule, day).await?;
        }
    }
    let schema_version = crate::pg::archive_segments::schema_version(&*client).await?;
    let mut rows = 0;
    for detached in archiving(&*client, rule.table).await? {
        rows += archive_and_drop(
            client,
            archive,
            rule,
            &detached,
            segment_rows,
            schema_version,
        )
        .await?;
    }
    Ok(rows)
}

/// Detaches `rule.table`'s partition of `day` as `<partition>_archiving`, unless it holds rows
/// that are not settled (kept attached, counted) or its lock is not granted within
/// [`LOCK_TIMEOUT_MS`] (left to the next pass).
async fn detach(
    client: &mut tokio_postgres::Client,
    rule: Rule,
    day: NaiveDate,
) -> Result<(), RetentionError> {
    let (table, name) = (
        rule.table,
        crate::pg::partitions::partition_name(rule.table, day),
    );
    let tx = client.transaction().await?;
    let detached = tx
        .batch_execute(&format!(
            "SET LOCAL lock_timeout = '{LOCK_TIMEOUT_MS}ms';
             ALTER TABLE {table} DETACH PARTITION {name};
             ALTER TABLE {name} RENAME TO {name}_archiving"
        ))
        .await;
    match detached {
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
            tracing::warn!(table, partition = %name, "day partition busy: left to the next pass");
            return Ok(());
        }
        other => other?,
    }
    let unsettled: bool = tx
        .query_one(
            &format!(
                "SELECT EXISTS (SELECT 1 FROM {name}_archiving WHERE NOT ({}))",
                rule.only
            ),
            &[],
        )
        .await?
        .get(0);
    if unsettled {
        // Dropping `tx` rolls the detach back.
        metrics::counter!("retention_partitions_held_total", "table" => table).increment(1);
        return Ok(());
    }
    Ok(tx.commit().await?)
}

/// Reads the detached partition `detached` in segments of `segment_rows`, each written to the
/// archive and catalogued, then moves the table's retention mark past its newest row and drops
/// it, all in one transaction. Returns the rows archived.
async fn archive_and_drop(
    client: &mut tokio_postgres::Client,
    archive: &Archive,
    rule: Rule,
    detached: &str,
    segment_rows: i64,
    schema_version: i32,
) -> Result<u64, RetentionError> {
    let (table, time_column) = (rule.table, rule.time_column);
    let tx = client.transaction().await?;
    tx.batch_execute(&format!(
        "DECLARE shed NO SCROLL CURSOR FOR SELECT to_jsonb(d), d.{time_column} FROM {detached} d"
    ))
    .await?;
    let mut rows = 0;
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
        archived(&manifest);
        rows += manifest.rows;
    }
    tx.execute(
        &format!(
            "INSERT INTO retention_marks (table_name, purged_before)
             SELECT $1, max(d.{time_column}) FROM {detached} d HAVING count(*) > 0
             {MARK_ONLY_FORWARD}"
        ),
        &[&table],
    )
    .await?;
    tx.batch_execute(&format!("CLOSE shed; DROP TABLE {detached}"))
        .await?;
    tx.commit().await?;
    metrics::counter!("retention_partitions_dropped_total", "table" => table).increment(1);
    Ok(rows)
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
