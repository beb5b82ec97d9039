//! What `seckill-bench soak` reads every `--sample-secs`: the stores' backlogs and table
//! sizes, the order-create lag, each process's memory, and the slope the verdict reads from
//! the memory samples.

use crate::cpu::CpuTarget;
use seckill::redis::RedisStore;

/// One sample: time since the start, and what was read.
pub(super) struct Sample {
    pub(super) t: f64,
    /// Anonymous memory (RssAnon) of each `--proc`, MiB; `None` once the process is gone.
    pub(super) anon_mib: Vec<Option<f64>>,
}

/// Least-squares slope of `(x, y)` points; `None` with fewer than three.
pub(super) fn slope(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 3 {
        return None;
    }
    let n = points.len() as f64;
    let (sx, sy) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    (den > 0.0).then(|| num / den)
}

/// A process's resident memory from /proc/<pid>/status: (VmRSS, RssAnon) in MiB.
fn rss_mib(pid: u32) -> Option<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> Option<f64> {
        status
            .lines()
            .find(|l| l.starts_with(key))?
            .split_whitespace()
            .nth(1)?
            .parse::<f64>()
            .ok()
    };
    Some((kib("VmRSS:")? / 1024.0, kib("RssAnon:")? / 1024.0))
}

/// The tables whose size and rows every sample shows.
const SAMPLED_TABLES: [&str; 8] = [
    "audit_events",
    "compensation_tasks",
    "consumer_inbox_by_day",
    "event_outbox_by_day",
    "order_commits",
    "orders",
    "reservations",
    "stock_ledger",
];

/// What every sample reads, and from where.
pub(super) struct Sampler {
    pub(super) pool: deadpool_postgres::Pool,
    pub(super) redis: RedisStore,
    pub(super) lag: seckill::mq::rocketmq::LagProbe,
    /// `(name on the line, consumer group, its topic)`.
    pub(super) groups: Vec<(&'static str, String, String)>,
    pub(super) procs: Vec<CpuTarget>,
    pub(super) activity_id: i64,
}

impl Sampler {
    /// One SAMPLE line every `every` until `stop`; the samples, for the memory verdict.
    pub(super) fn spawn(
        self,
        every: std::time::Duration,
        started: std::time::Instant,
        stop: tokio_util::sync::CancellationToken,
    ) -> tokio::task::JoinHandle<Vec<Sample>> {
        tokio::spawn(async move {
            let mut samples: Vec<Sample> = Vec::new();
            let mut since = chrono::Utc::now();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let now = chrono::Utc::now();
                let line = match self.sample(since, now).await {
                    Ok((line, anon)) => {
                        samples.push(Sample {
                            t: started.elapsed().as_secs_f64(),
                            anon_mib: anon,
                        });
                        line
                    }
                    Err(e) => format!("(not sampled: {e:#})"),
                };
                println!("SAMPLE t={:.0} {line}", started.elapsed().as_secs_f64());
                since = now;
            }
            self.lag.shutdown().await;
            samples
        })
    }

    /// One sample line, and the anonymous memory of each process.
    async fn sample(
        &self,
        since: chrono::DateTime<chrono::Utc>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<(String, Vec<Option<f64>>)> {
        let pg = self.pool.get().await?;
        let (memory, anon) = self.memory();
        let parts = [
            self.orders(&pg, since, now).await?,
            tables(&pg).await?,
            self.redis_memory().await?,
            self.lags().await,
            memory,
        ];
        Ok((parts.join(" "), anon))
    }

    /// Orders created and cancelled in the interval, their ages, and the overdue.
    async fn orders(
        &self,
        pg: &tokio_postgres::Client,
        since: chrono::DateTime<chrono::Utc>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<String> {
        let row = pg
            .query_one(
                "SELECT (SELECT count(*) FROM order_commits c JOIN orders o USING (xact_id)
                          WHERE c.committed_at > $2 AND c.committed_at <= $3 AND o.activity_id = $1),
                        (SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                                  extract(epoch FROM c.committed_at - o.reserved_at)), 0)::float8
                           FROM order_commits c JOIN orders o USING (xact_id)
                          WHERE c.committed_at > $2 AND c.committed_at <= $3 AND o.activity_id = $1),
                        (SELECT count(*) FROM orders
                          WHERE activity_id = $1 AND canceled_at > $2 AND canceled_at <= $3),
                        (SELECT coalesce(percentile_cont(0.99) WITHIN GROUP (ORDER BY
                                  extract(epoch FROM canceled_at - expires_at)), 0)::float8
                           FROM orders
                          WHERE activity_id = $1 AND canceled_at > $2 AND canceled_at <= $3),
                        (SELECT count(*) FROM orders
                          WHERE status IN ('CREATED', 'PAYING') AND expires_at < now())",
                &[&self.activity_id, &since, &now],
            )
            .await?;
        let window = (now - since).num_milliseconds().max(1) as f64 / 1000.0;
        Ok(format!(
            "created_per_s={:.0} order_age_p99_ms={:.0} canceled_per_s={:.0} cancel_age_p99_s={:.2} overdue={}",
            row.get::<_, i64>(0) as f64 / window,
            row.get::<_, f64>(1) * 1000.0,
            row.get::<_, i64>(2) as f64 / window,
            row.get::<_, f64>(3),
            row.get::<_, i64>(4),
        ))
    }

    async fn redis_memory(&self) -> anyhow::Result<String> {
        let mut conn = self.redis.pool.get().await?;
        let info: String = deadpool_redis::redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut *conn)
            .await?;
        let used = info
            .lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        Ok(format!("redis_mib={:.1}", used / 1_048_576.0))
    }

    /// Each group's lag: messages and the oldest unconsumed one's age.
    async fn lags(&self) -> String {
        let mut lags = Vec::new();
        for (name, group, topic) in &self.groups {
            lags.push(match self.lag.lag(group, topic).await {
                Ok(l) => format!(
                    "{name}:{}/{:.1}s",
                    l.messages,
                    l.oldest_unconsumed_age_ms.unwrap_or(0) as f64 / 1000.0
                ),
                Err(_) => format!("{name}:?"),
            });
        }
        format!("lag={}", lags.join(","))
    }

    /// Each process's resident and anonymous memory; the anonymous, for the verdict.
    fn memory(&self) -> (String, Vec<Option<f64>>) {
        let mut anon = Vec::new();
        let mut rss = Vec::new();
        for p in &self.procs {
            let read: Vec<(f64, f64)> = p.pids.iter().filter_map(|&pid| rss_mib(pid)).collect();
            if read.is_empty() {
                anon.push(None);
                rss.push(format!("{}:gone", p.name));
            } else {
                let (v, a) = read
                    .iter()
                    .fold((0.0, 0.0), |(v, a), (rv, ra)| (v + rv, a + ra));
                anon.push(Some(a));
                rss.push(format!("{}:{v:.0}/{a:.0}", p.name));
            }
        }
        (format!("rss_anon_mib={}", rss.join(",")), anon)
    }
}

/// Size on disk, and the exact row count (not the planner's estimate, which only a VACUUM or
/// ANALYZE refreshes), of each sampled table.
async fn tables(pg: &tokio_postgres::Client) -> anyhow::Result<String> {
    let mut tables = Vec::new();
    for table in SAMPLED_TABLES {
        let row = pg
            .query_one(
                &format!(
                    // A partitioned table's bytes are its partitions'.
                    "SELECT greatest(pg_total_relation_size('{table}'),
                                     (SELECT coalesce(sum(pg_total_relation_size(relid)), 0)
                                      FROM pg_partition_tree('{table}') WHERE isleaf))::float8
                            / 1048576, count(*)
                     FROM {table}"
                ),
                &[],
            )
            .await?;
        tables.push(format!(
            "{table}:{:.1}/{}",
            row.get::<_, f64>(0),
            row.get::<_, i64>(1)
        ));
    }
    // What retention moved out of those tables, as its catalogue counts it: the archive's
    // growth beside the tables it keeps flat.
    let archive = pg
        .query_one(
            "SELECT coalesce(sum(bytes), 0)::float8 / 1048576, coalesce(sum(row_count), 0)::bigint,
                    count(*) FROM archive_segments",
            &[],
        )
        .await?;
    Ok(format!(
        "pg_mib_rows={} archive_mib_rows_segments={:.2}/{}/{}",
        tables.join(","),
        archive.get::<_, f64>(0),
        archive.get::<_, i64>(1),
        archive.get::<_, i64>(2)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_of_a_line_and_of_too_few_points() {
        let line: Vec<(f64, f64)> = (0..10).map(|x| (x as f64, 3.0 * x as f64 + 1.0)).collect();
        assert!((slope(&line).unwrap() - 3.0).abs() < 1e-9);
        let flat: Vec<(f64, f64)> = (0..10).map(|x| (x as f64, 7.0)).collect();
        assert_eq!(slope(&flat), Some(0.0));
        assert_eq!(slope(&line[..2]), None);
    }
}
