//! How big the tables that grow with every request are (docs/RUNBOOK.md#table-growth): bytes
//! on disk and the planner's row estimate, a partitioned table summed over its partitions, and
//! the age of the oldest day partition of a table partitioned by day.

use tokio_postgres::GenericClient;

/// The tables every order, message or event adds rows to.
pub const GROWING: [&str; 11] = [
    "audit_events",
    "compensation_tasks",
    // The unpartitioned tables releases before V25 write, kept equal to their by-day twins
    // until the contract step drops them (docs/architecture/postgresql.md#tables-by-day).
    "consumer_inbox",
    "consumer_inbox_by_day",
    "dlq_messages",
    "event_outbox",
    "event_outbox_by_day",
    "order_commits",
    "orders",
    "reservations",
    "stock_ledger",
];

/// One table's size.
#[derive(Debug, Clone, PartialEq)]
pub struct TableSize {
    pub table: &'static str,
    pub bytes: i64,
    /// The planner's estimate (`pg_class.reltuples`, refreshed by ANALYZE): cheap to read at
    /// any size, unlike `count(*)`.
    pub rows: i64,
}

/// The size of each of [`GROWING`] (0 for a table this schema lacks).
pub async fn growing(client: &impl GenericClient) -> Result<Vec<TableSize>, tokio_postgres::Error> {
    let mut out = Vec::new();
    for table in GROWING {
        let row = client
            .query_one(
                "WITH r AS (SELECT to_regclass($1) AS oid),
                      leaves AS (
                        SELECT t.relid FROM r, pg_partition_tree(r.oid) t WHERE t.isleaf
                        UNION SELECT r.oid FROM r JOIN pg_class c ON c.oid = r.oid
                              WHERE c.relkind = 'r')
                 SELECT coalesce(sum(pg_total_relation_size(l.relid)), 0)::int8,
                        coalesce(sum(greatest(c.reltuples, 0)), 0)::int8
                 FROM leaves l JOIN pg_class c ON c.oid = l.relid",
                &[&table],
            )
            .await?;
        out.push(TableSize {
            table,
            bytes: row.get(0),
            rows: row.get(1),
        });
    }
    Ok(out)
}

/// Seconds since the start of the oldest day partition (`<table>_pYYYYMMDD`) of `table`;
/// `None` when it has none.
pub async fn oldest_day_partition_age_secs(
    client: &impl GenericClient,
    table: &str,
) -> Result<Option<f64>, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT extract(epoch FROM now() - min(to_date(right(c.relname, 8), 'YYYYMMDD')
                                              ::timestamp AT TIME ZONE 'UTC'))::float8
             FROM pg_partition_tree(to_regclass($1)) t JOIN pg_class c ON c.oid = t.relid
             WHERE t.isleaf AND c.relname ~ ('^' || $1 || '_p[0-9]{8}$')",
            &[&table],
        )
        .await?;
    Ok(row.get(0))
}

/// How far retention is behind on a table partitioned by day whose oldest partition began
/// `oldest_age_secs` ago: a day is due once its end is `retention` old, so its start is then
/// `retention` plus a day old; past that, the seconds it has waited (0 when none).
pub fn retention_lag_secs(oldest_age_secs: f64, retention: std::time::Duration) -> f64 {
    (oldest_age_secs - retention.as_secs_f64() - 86_400.0).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::retention_lag_secs;
    use std::time::Duration;

    #[test]
    fn a_day_is_late_once_its_end_is_past_retention() {
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(retention_lag_secs(0.0, week), 0.0);
        assert_eq!(retention_lag_secs(8.0 * 86_400.0, week), 0.0);
        assert_eq!(retention_lag_secs(8.0 * 86_400.0 + 60.0, week), 60.0);
    }
}
