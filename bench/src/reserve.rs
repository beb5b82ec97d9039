//! `seckill-bench reserve`: the reservation script's own rate for one hot SKU, with its stock
//! split into `--buckets` stock buckets, and, on Redis Cluster, each primary's share of the
//! calls (docs/architecture/redis.md#stock-buckets).
//!
//! It warms one activity (Redis only) with twice as many units as requests, then makes `--requests`
//! reservations, one per buyer, `--concurrency` at a time, through `Intake::reserve` (the
//! script and key layout the API uses; nothing is sent to the broker). Each primary's share is
//! the change of its `EVALSHA`/`EVAL` call counts (`INFO commandstats`) over the run. The
//! activity's keys are removed at the end.

use std::time::Instant;

use anyhow::Context as _;
use chrono::Utc;
use clap::Args;
use deadpool_redis::redis;
use futures::StreamExt;

use seckill::config::{RedisMode, Settings};
use seckill::domain::ids::Ids;
use seckill::domain::order_create::ReservationRef;
use seckill::redis::{RedisStore, ReserveArgs, ReserveResult};

#[derive(Debug, Clone, Args)]
pub struct ReserveRunArgs {
    #[arg(long)]
    pub activity_id: i64,
    /// Stock buckets the SKU is split into.
    #[arg(long, default_value_t = 1)]
    pub buckets: u16,
    #[arg(long, default_value_t = 100_000)]
    pub requests: usize,
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
}

/// Script calls served by one Redis primary so far (`EVALSHA` + `EVAL`).
async fn script_calls(url: &str) -> anyhow::Result<u64> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    Ok(info
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split(',')
                .find_map(|f| f.split_once("calls=").map(|(_, n)| n))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum())
}

/// The primaries to read: every master of the cluster the first seed knows, or the one server.
async fn primaries(settings: &Settings) -> anyhow::Result<Vec<String>> {
    let seed = settings.redis.urls()[0].to_string();
    if settings.redis.mode != RedisMode::Cluster {
        return Ok(vec![seed]);
    }
    let client = redis::Client::open(seed.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await?;
    let mut out: Vec<String> = nodes
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let flags = f.get(2)?;
            let addr = f.get(1)?.split('@').next()?;
            (flags.contains("master") && !flags.contains("fail")).then(|| format!("redis://{addr}"))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Removes every key of the activity's shards (each shard's keys share one slot, one node).
async fn purge(redis: &RedisStore, activity_id: i64) -> anyhow::Result<()> {
    for shard in redis.shards(activity_id).await? {
        let pattern = format!("{}:*", redis.keys.tag(shard));
        let slot = redis.keys.slot(shard);
        let mut conn = redis.pool.get().await?;
        let mut cursor = 0u64;
        loop {
            let (next, keys) = conn.scan_page(slot, cursor, &pattern).await?;
            if !keys.is_empty() {
                let _: i64 = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut *conn)
                    .await?;
            }
            cursor = next;
            if cursor == 0 {
                break;
            }
        }
    }
    let mut conn = redis.pool.get().await?;
    let _: i64 = redis::cmd("SREM")
        .arg(redis.keys.activities())
        .arg(activity_id)
        .query_async(&mut *conn)
        .await?;
    Ok(())
}

pub async fn run(settings: Settings, args: ReserveRunArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(args.requests > 0 && args.concurrency > 0, "nothing to run");
    let redis = RedisStore::connect(&settings.redis).await?;
    let now = Utc::now().timestamp_millis();
    let warmed = redis
        .stock()
        .warm(
            args.activity_id,
            1,
            now - 1_000,
            now + 3_600_000,
            600_000,
            // Twice the requests: no bucket runs out, however the buyers map (no rebalancer
            // runs here), so every call is a reservation.
            i32::try_from(args.requests * 2).context("--requests")?,
            args.buckets,
        )
        .await?;
    eprintln!("activity {} warmed: {warmed:?}", args.activity_id);
    let nodes = primaries(&settings).await?;
    let mut before = Vec::new();
    for n in &nodes {
        before.push(script_calls(n).await?);
    }
    let started = Instant::now();
    let outcomes: Vec<anyhow::Result<bool>> = futures::stream::iter(0..args.requests)
        .map(|i| reserve_one(&redis, args.activity_id, i))
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let secs = started.elapsed().as_secs_f64();
    let mut reserved = 0usize;
    for o in outcomes {
        reserved += usize::from(o?);
    }
    let mut calls = Vec::new();
    for (n, b) in nodes.iter().zip(&before) {
        calls.push(script_calls(n).await?.saturating_sub(*b));
    }
    let (max_share, shares) = primary_shares(&nodes, &calls);
    purge(&redis, args.activity_id).await?;
    println!(
        "RESERVE mode={} buckets={} requests={} reserved={} secs={:.3} calls_per_sec={:.0} max_primary_share={:.3} shares={}",
        if settings.redis.mode == RedisMode::Cluster { "cluster" } else { "standalone" },
        args.buckets,
        args.requests,
        reserved,
        secs,
        args.requests as f64 / secs,
        max_share,
        shares
    );
    if reserved != args.requests {
        eprintln!(
            "only {reserved} of {} calls made a reservation",
            args.requests
        );
    }
    Ok(reserved == args.requests)
}

/// Buyer `i + 1` reserves one unit of SKU 1 in their home bucket, as the API would; whether it
/// made a reservation.
async fn reserve_one(redis: &RedisStore, activity_id: i64, i: usize) -> anyhow::Result<bool> {
    let user_id = 1 + i as i64;
    let bucket = redis.home_shard(activity_id, user_id).await?.bucket;
    let ids = Ids::generate(activity_id, bucket);
    let request_id = format!("rr-{i}");
    let now_ms = Utc::now().timestamp_millis();
    let a = ReserveArgs {
        reservation: ReservationRef {
            message_id: &ids.message_id,
            request_id: &request_id,
            reservation_id: &ids.reservation_id,
            order_id: &ids.order_id,
            activity_id,
            sku_id: 1,
            user_id,
        },
        now_ms,
        next_retry_at_ms: now_ms + 3_600_000,
        traceparent: "",
        valid_secs: 600,
        limits: Default::default(),
        channel: "",
        pass_id: "",
    };
    Ok(matches!(
        redis.intake().reserve(&a).await?,
        ReserveResult::Reserved(_)
    ))
}

/// The largest share of the script calls one primary took, and every primary's
/// (`port:share,...`).
fn primary_shares(nodes: &[String], calls: &[u64]) -> (f64, String) {
    let total: u64 = calls.iter().sum::<u64>().max(1);
    let shares: Vec<String> = nodes
        .iter()
        .zip(calls)
        .map(|(n, c)| {
            format!(
                "{}:{:.3}",
                n.rsplit(':').next().unwrap_or(n),
                *c as f64 / total as f64
            )
        })
        .collect();
    let max_share = calls.iter().copied().max().unwrap_or(0) as f64 / total as f64;
    (max_share, shares.join(","))
}
