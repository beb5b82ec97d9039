//! The order tables between drains: emptied before each batched round as pgbench's are before
//! each of its runs, and set up before every drain as pgbench's runs find theirs
//! (bench/limits/limits.sh, `reset_order_tables`).

use seckill::redis::RedisStore;

use super::Run;

/// Processed messages of earlier sales in the inbox when a drain starts, as pgbench's runs
/// start with (`INBOX_HISTORY` in bench/limits/limits.sh).
const INBOX_HISTORY: i64 = 100_000;

/// The tables an order transaction fills, as limits.sh's `reset_order_tables` lists them: emptied
/// before each batched round ([`reset_order_tables`]), vacuumed before every drain
/// ([`like_pgbench_start`]).
const ORDER_TABLES: [&str; 5] = [
    "consumer_inbox_by_day",
    "reservations",
    "orders",
    "stock_ledger",
    "event_outbox_by_day",
];

/// The order tables as pgbench's runs find theirs (bench/limits/limits.sh,
/// `reset_order_tables`): an inbox holding `INBOX_HISTORY` processed messages of an earlier
/// sale, every order table vacuumed and analyzed, a checkpoint taken. A production inbox has
/// its history and autovacuum's statistics; a schema migrated a second ago has neither, and
/// its first plans read the whole inbox (BENCHMARKS.md, "The order work's price").
/// `BENCH_FRESH_START=1` leaves the tables as the migration and earlier scenarios left them
/// (the figures before this start was added).
pub(super) async fn like_pgbench_start(run: &Run) -> anyhow::Result<()> {
    if std::env::var("BENCH_FRESH_START").is_ok_and(|v| v == "1") {
        eprintln!("[bench] BENCH_FRESH_START=1: the order tables as they are, never analyzed");
        return Ok(());
    }
    // The history, the VACUUMs and the CHECKPOINT take longer than the hot path's statement
    // bound on a slow or held PostgreSQL (the crowd gives it a quarter core): a long bound
    // for them, the run's own given back after.
    seckill::pg::set_statement_timeout(&run.pg, 600).await?;
    let prepared = history_and_statistics(run).await;
    seckill::pg::reset_statement_timeout(&run.pg, run.settings.pg.statement_timeout_ms).await?;
    prepared
}

async fn history_and_statistics(run: &Run) -> anyhow::Result<()> {
    let group = run.settings.names().order_create_group.clone();
    let s = &run.schema;
    let have = run
        .count("SELECT count(*) FROM {s}.consumer_inbox_by_day WHERE activity_id = 0")
        .await;
    let sql = format!(
        "INSERT INTO {s}.consumer_inbox_by_day
             (consumer_group, message_id, topic, reservation_id, order_id, status, decision,
              received_at, updated_at, activity_id, id_at)
         SELECT $1, 'evt_old' || lpad(i::text, 23, '0'), 'history',
                'rsv_old' || lpad(i::text, 23, '0'), 'ord_old' || lpad(i::text, 23, '0'),
                'SUCCEEDED', 'CREATED', now() - interval '1 day', now() - interval '1 day', 0,
                now() - interval '1 day'
         FROM generate_series($2::int8 + 1, $3::int8) AS i"
    );
    run.pg
        .execute(sql.as_str(), &[&group, &have.max(0), &INBOX_HISTORY])
        .await?;
    for table in std::iter::once("stock_buckets").chain(ORDER_TABLES) {
        run.pg
            .batch_execute(&format!("VACUUM ANALYZE {s}.{table}"))
            .await?;
    }
    run.pg.batch_execute("CHECKPOINT").await?;
    Ok(())
}

/// The order tables pgbench's runs truncate before each run (bench/limits/limits.sh,
/// `reset_order_tables`), emptied in the bench's schema; [`like_pgbench_start`] then puts back
/// the inbox's history, vacuums and checkpoints. Only the rows of drains already checked are
/// lost: the rounds run first among the scenarios that write orders.
///
/// Their activities end first, in Redis, as a finished sale does (off the scanner's list, the
/// keys expiring): with the orders gone, a scan role started later would find each of their
/// confirmed sends missing from the inbox and send it again, which is the repair a lost order
/// gets, and the consumer would write every one of them a second time beside the scenarios
/// after (36,630 orders written again during the relay's 70 s once, its rate a third of what
/// it is alone: BENCHMARKS.md, "The outbox relay").
pub(super) async fn reset_order_tables(run: &Run) -> anyhow::Result<()> {
    let s = &run.schema;
    let ended: Vec<i64> = run
        .pg
        .query(
            &format!("SELECT DISTINCT activity_id FROM {s}.reservations"),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !ended.is_empty() {
        let redis = RedisStore::connect(&run.settings.redis).await?;
        let keep = u64::from(run.settings.retention.activity_keys_hours) * 3600;
        for activity_id in ended {
            redis.recovery().retire_activity(activity_id, keep).await?;
        }
    }
    let tables: Vec<String> = ORDER_TABLES.iter().map(|t| format!("{s}.{t}")).collect();
    run.pg
        .batch_execute(&format!("TRUNCATE {}", tables.join(", ")))
        .await?;
    Ok(())
}
