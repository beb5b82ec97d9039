//! The outbox relay's scenario: a fresh `seckill scan` draining, alone, the events the order
//! backlogs left in the outbox (BENCHMARKS.md, "The outbox relay").
//!
//! What it measures is the backlog **due at its start**, and only that: those rows, counted
//! once, and the time until every one of them is SENT. A row of it the relay has claimed (its
//! lease pushes `next_attempt_at` ahead) or put off after a failed send is still owed; a row
//! written during the drain, or one not yet due at the start that comes due during it, is not
//! part of it. Counting "PENDING and due now" instead, as this scenario once did, reads a
//! figure that moves by itself: it can reach 0 while the backlog's last rows are leased or put
//! off (too early), and a recount then finds rows due again (`left=16` once, after 106 s): the
//! verdict depended on the moment it was read.

use std::time::{Duration, Instant};

use super::procs::{poll_until, wait_ready};
use super::{Run, SCAN_READY};
use crate::ratios::Line;

/// The moment the backlog is taken, in temporary tables of the bench's session: `relay_start`
/// (the time, the rows due) and `relay_outside` (the rows that are not part of it although
/// written before it: PENDING rows not yet due then, timers held back or rows put off, and the
/// DEAD rows then; a few). One snapshot (REPEATABLE READ) for all. Returns the rows due.
pub async fn take_backlog(pg: &tokio_postgres::Client, schema: &str) -> anyhow::Result<i64> {
    pg.batch_execute("DROP TABLE IF EXISTS relay_start, relay_outside")
        .await?;
    pg.batch_execute(&format!(
        "BEGIN ISOLATION LEVEL REPEATABLE READ;
         CREATE TEMP TABLE relay_start AS SELECT now() AS t0,
             (SELECT count(*) FROM {schema}.event_outbox_by_day
               WHERE status = 'PENDING' AND next_attempt_at <= now()) AS due;
         CREATE TEMP TABLE relay_outside AS SELECT activity_id, event_id FROM {schema}.event_outbox_by_day
               WHERE (status = 'PENDING' AND next_attempt_at > now()) OR status = 'DEAD';
         ALTER TABLE relay_outside ADD PRIMARY KEY (activity_id, event_id);
         ANALYZE relay_outside;
         COMMIT;"
    ))
    .await?;
    Ok(pg
        .query_one("SELECT due FROM relay_start", &[])
        .await?
        .get(0))
}

/// The rows of [`take_backlog`]'s backlog not SENT yet: PENDING (due or not) or DEAD, written
/// before the start, not outside the backlog then. A row written by a transaction that began
/// before the start but committed after it counts while it is PENDING (none in `make bench`:
/// nothing writes orders when the relay starts).
fn owed_rows(schema: &str) -> String {
    ["PENDING", "DEAD"]
        .map(|status| {
            format!(
                "SELECT 1 FROM {schema}.event_outbox_by_day o
                  WHERE o.status = '{status}' AND o.created_at <= (SELECT t0 FROM relay_start)
                    AND NOT EXISTS (SELECT 1 FROM relay_outside x
                                     WHERE x.activity_id = o.activity_id
                                       AND x.event_id = o.event_id)"
            )
        })
        .join(" UNION ALL ")
}

/// Runs `sql` reading the outbox's partial indexes whatever its statistics say: no
/// sequential scan of its SENT rows, no parallel workers, no JIT. The bench must not take the
/// cores the relay it times needs: a count that read the whole table (535 ms, 215 of them
/// compiling it) every 100 ms once kept a core of PostgreSQL busy through the drain.
async fn on_indexes(pg: &tokio_postgres::Client, sql: &str) -> anyhow::Result<i64> {
    pg.batch_execute(&format!(
        "BEGIN; {}",
        seckill::pg::outbox::ON_PARTIAL_INDEXES
    ))
    .await?;
    let n = pg.query_one(sql, &[]).await.map(|r| r.get::<_, i64>(0));
    pg.batch_execute(if n.is_ok() { "COMMIT" } else { "ROLLBACK" })
        .await?;
    Ok(n?)
}

/// How many rows of the backlog are still owed (see [`owed_rows`]).
pub async fn backlog_left(pg: &tokio_postgres::Client, schema: &str) -> anyhow::Result<i64> {
    let sql = format!("SELECT count(*) FROM ({}) owed", owed_rows(schema));
    on_indexes(pg, &sql).await
}

/// Whether any row of the backlog is still owed: stops at the first one, so polling it costs
/// little while the backlog is large.
pub async fn backlog_owed(pg: &tokio_postgres::Client, schema: &str) -> anyhow::Result<bool> {
    let sql = format!("SELECT count(*) FROM ({} LIMIT 1) owed", owed_rows(schema));
    Ok(on_indexes(pg, &sql).await? > 0)
}

/// The scenario: the backlog taken, a fresh scan role started, its drain timed.
pub(super) async fn relay(run: &mut Run) -> anyhow::Result<()> {
    let rows = take_backlog(&run.pg, &run.schema).await?;
    eprintln!("[bench] outbox relay on a backlog of {rows} events");
    let started = Instant::now();
    run.procs.start("scan", &["scan"], None)?;
    let (pg, schema) = (&run.pg, run.schema.as_str());
    poll_until(
        Duration::from_secs(180),
        Duration::from_millis(100),
        || async move { backlog_owed(pg, schema).await.is_ok_and(|owed| !owed) },
    )
    .await;
    let secs = started.elapsed().as_secs_f64();
    let left = backlog_left(&run.pg, &run.schema).await.unwrap_or(-1);
    run.pg
        .batch_execute("DROP TABLE IF EXISTS relay_start, relay_outside")
        .await?;
    let verdict = if left == 0 { "OK" } else { "FAILED" };
    let text = format!(
        "RELAY {verdict} rows={rows} left={left} seconds={secs:.2} events_per_s={:.0}",
        rows as f64 / secs
    );
    eprintln!("[bench] {text}");
    run.keep("RELAY", Line::parse(&text));
    wait_ready(SCAN_READY).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One outbox row, `status`, due `due_in` seconds from now.
    async fn row(pg: &tokio_postgres::Client, schema: &str, id: &str, status: &str, due_in: i32) {
        pg.execute(
            &format!(
                "INSERT INTO {schema}.event_outbox_by_day
                   (activity_id, event_id, topic, tag, message_key, payload, status, next_attempt_at,
                    id_at)
                 VALUES (1, $1, 't', 'ORDER_CREATED', $1, '{{}}', $2,
                         now() + make_interval(secs => $3), seckill_id_at($1))"
            ),
            &[&id, &status, &f64::from(due_in)],
        )
        .await
        .unwrap();
    }

    async fn set(pg: &tokio_postgres::Client, schema: &str, id: &str, change: &str) {
        pg.execute(
            &format!("UPDATE {schema}.event_outbox_by_day SET {change} WHERE event_id = $1"),
            &[&id],
        )
        .await
        .unwrap();
    }

    /// What the scenario counted before: PENDING rows due now.
    async fn due_now(pg: &tokio_postgres::Client, schema: &str) -> i64 {
        let sql = format!(
            "SELECT count(*) FROM {schema}.event_outbox_by_day
              WHERE status = 'PENDING' AND next_attempt_at <= now()"
        );
        pg.query_one(&sql, &[]).await.unwrap().get(0)
    }

    /// Rows that become due, are leased or are written during the drain move neither end of
    /// the measurement: the backlog is the rows due at its start, until each is SENT.
    #[tokio::test]
    async fn the_backlog_is_the_rows_due_at_the_start_whatever_moves_during_the_drain() {
        let mut settings = seckill::config::Settings::load_from(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../config"
        )))
        .expect("config loads");
        let ulid = ulid::Ulid::new().to_string().to_lowercase();
        settings.pg.schema = format!("t_relay_{}", &ulid[ulid.len() - 10..]);
        seckill::pg::migrate_contracting_new(&settings.pg)
            .await
            .expect("migrations apply");
        let (pg, conn) = seckill::pg::connect_one(&settings.pg).await.unwrap();
        tokio::spawn(conn);
        let s = settings.pg.schema.clone();
        for id in ["a1", "a2", "a3"] {
            row(&pg, &s, id, "PENDING", -1).await;
        }
        row(&pg, &s, "timer", "PENDING", 3600).await;
        row(&pg, &s, "old-dead", "DEAD", -1).await;
        row(&pg, &s, "old-sent", "SENT", -1).await;
        assert_eq!(take_backlog(&pg, &s).await.unwrap(), 3);
        assert_eq!(backlog_left(&pg, &s).await.unwrap(), 3);

        // Two sent; the third claimed, its lease ahead: nothing due now, one still owed.
        set(&pg, &s, "a1", "status = 'SENT'").await;
        set(&pg, &s, "a2", "status = 'SENT'").await;
        set(&pg, &s, "a3", "next_attempt_at = now() + interval '30 s'").await;
        assert_eq!(due_now(&pg, &s).await, 0, "the old count would stop here");
        assert_eq!(backlog_left(&pg, &s).await.unwrap(), 1);

        // A row written during the drain, due at once, and the held-back timer come due.
        row(&pg, &s, "cancelled-during-drain", "PENDING", -1).await;
        set(&pg, &s, "timer", "next_attempt_at = now()").await;
        assert_eq!(due_now(&pg, &s).await, 2, "the old recount would fail here");
        assert_eq!(backlog_left(&pg, &s).await.unwrap(), 1);

        // The leased row given up on is owed still; sent, the backlog is done.
        set(&pg, &s, "a3", "status = 'DEAD'").await;
        assert_eq!(backlog_left(&pg, &s).await.unwrap(), 1);
        assert!(backlog_owed(&pg, &s).await.unwrap());
        set(&pg, &s, "a3", "status = 'SENT'").await;
        assert_eq!(backlog_left(&pg, &s).await.unwrap(), 0);
        assert!(
            !backlog_owed(&pg, &s).await.unwrap(),
            "the poll stops where the count is 0"
        );

        pg.batch_execute(&format!("DROP SCHEMA {s} CASCADE"))
            .await
            .unwrap();
    }
}
