//! `seckill activity create`: writes an activity and its SKU stock to PostgreSQL, then warms
//! Redis. Idempotent; it refuses to change the stock of an activity that has started.

use anyhow::Context as _;
use chrono::{DateTime, Duration, Utc};
use clap::Args;
use tracing::info;

use crate::config::Settings;
use crate::pg::queries::{self, ActivitySpec};
use crate::redis::{RedisStore, WarmResult};

#[derive(Debug, Clone, Args)]
pub struct CreateArgs {
    #[arg(long)]
    pub activity_id: i64,
    #[arg(long, default_value = "flash sale")]
    pub name: String,
    /// `sku_id:stock[:price_cents]`, repeatable.
    #[arg(long = "sku", required = true, value_parser = parse_sku)]
    pub skus: Vec<(i64, i32, i64)>,
    /// Start time (RFC 3339); default: now.
    #[arg(long)]
    pub starts_at: Option<DateTime<Utc>>,
    /// Length of the sale.
    #[arg(long, default_value_t = 3600)]
    pub duration_secs: i64,
    /// How long a reservation may wait for its order; default: `api.reservation_valid_secs`.
    #[arg(long)]
    pub reservation_valid_secs: Option<i32>,
    /// Split each SKU's stock into this many buckets (1-64), each its own Redis hash tag and
    /// its own PostgreSQL stock row, for a SKU hotter than one Redis shard or one row lock
    /// (docs/architecture/redis.md#stock-buckets). Fixed once the activity exists.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i16).range(1..=64))]
    pub stock_buckets: i16,
    /// A fair start (docs/architecture/hot-path.md#a-fair-start): the sale's first this many
    /// milliseconds go to a draw among every buyer who asks (each held until it closes),
    /// not to the fastest requests; 0: first come first served. At most what a held request
    /// can wait (`api.request_timeout_ms` less `mq.send_timeout_ms` and 500 ms); fixed once
    /// the sale has started. The draw's seed is made once and kept with the activity.
    #[arg(long)]
    pub fair_window_ms: Option<u32>,
    /// Sale passes (docs/architecture/hot-path.md#sale-passes): sell only to buyers who registered
    /// for a pass (POST /v1/activities/{id}/passes) before the sale, at most this many passes.
    #[arg(long)]
    pub passes: Option<u32>,
    /// When pass registration opens (RFC 3339); default: when the activity was created.
    #[arg(long, requires = "passes")]
    pub pass_registration_opens_at: Option<DateTime<Utc>>,
    /// When pass registration closes (RFC 3339, at the latest the sale's end); default: the
    /// sale's start.
    #[arg(long, requires = "passes")]
    pub pass_registration_closes_at: Option<DateTime<Utc>>,
    /// A registration must carry a proof of work of about this many counters (ALTCHA, grown
    /// with the load by `passes.pow_*`); 0: none.
    #[arg(long, default_value_t = 0, requires = "passes")]
    pub pass_pow_difficulty: u32,
}

fn parse_sku(s: &str) -> Result<(i64, i32, i64), String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("`{s}`: expected sku_id:stock[:price_cents] with sku_id > 0, stock >= 0");
    if !(2..=3).contains(&parts.len()) {
        return Err(bad());
    }
    let sku: i64 = parts[0].parse().map_err(|_| bad())?;
    let stock: i32 = parts[1].parse().map_err(|_| bad())?;
    let price: i64 = parts
        .get(2)
        .map(|p| p.parse())
        .transpose()
        .map_err(|_| bad())?
        .unwrap_or(0);
    if sku <= 0 || stock < 0 || price < 0 {
        return Err(bad());
    }
    Ok((sku, stock, price))
}

/// Creates (or re-asserts) the activity in PostgreSQL, then warms Redis from it.
pub async fn create(settings: &Settings, args: &CreateArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.activity_id > 0, "--activity-id must be positive");
    anyhow::ensure!(args.duration_secs > 0, "--duration-secs must be positive");
    let now = Utc::now();
    let starts_at = args.starts_at.unwrap_or(now);
    let valid = args
        .reservation_valid_secs
        .unwrap_or(settings.api.reservation_valid_secs as i32);
    anyhow::ensure!(valid > 0, "--reservation-valid-secs must be positive");
    let spec = ActivitySpec {
        activity_id: args.activity_id,
        name: args.name.clone(),
        starts_at,
        ends_at: starts_at + Duration::seconds(args.duration_secs),
        reservation_valid_secs: valid,
        skus: args.skus.clone(),
        stock_buckets: args.stock_buckets,
    };
    let (mut client, conn) = crate::pg::connect_one(&settings.pg).await?;
    let conn = tokio::spawn(conn);
    queries::create_activity(&mut client, &spec, now).await?;
    let (fair_ms, seed) = fair_window(settings, args, &client, now).await?;
    let passes_required = pass_policy(args, &client, now).await?;
    // Warm Redis from what PostgreSQL holds (an earlier, started run keeps its values).
    let (starts, ends, valid_secs, skus, buckets) = queries::activity(&client, args.activity_id)
        .await?
        .context("activity vanished after create")?;
    drop(client);
    let _ = conn.await;
    let redis = RedisStore::connect(&settings.redis).await?;
    let window = (starts.timestamp_millis(), ends.timestamp_millis());
    for (sku_id, total) in skus {
        let r = warm_sku(
            &redis,
            args.activity_id,
            sku_id,
            window,
            valid_secs,
            total,
            buckets,
        )
        .await?;
        println!(
            "activity {} sku {sku_id}: stock {total} in {buckets} bucket(s), {} .. {} ({:?})",
            args.activity_id,
            starts.to_rfc3339(),
            ends.to_rfc3339(),
            r
        );
    }
    redis
        .draws()
        .set_fair_start(
            args.activity_id,
            fair_ms as u64,
            seed.as_deref().unwrap_or(""),
        )
        .await?;
    redis
        .passes()
        .set_passes(args.activity_id, passes_required)
        .await?;
    if fair_ms > 0 {
        println!(
            "activity {}: fair window {fair_ms} ms from the start, seed {}",
            args.activity_id,
            seed.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// Warms one SKU into Redis as PostgreSQL holds it: refused when Redis holds reservations of
/// it already, or holds the activity in another number of stock buckets.
async fn warm_sku(
    redis: &RedisStore,
    activity_id: i64,
    sku_id: i64,
    (starts_ms, ends_ms): (i64, i64),
    valid_secs: i32,
    total: i32,
    buckets: i16,
) -> anyhow::Result<WarmResult> {
    let r = redis
        .stock()
        .warm(
            activity_id,
            sku_id,
            starts_ms,
            ends_ms,
            i64::from(valid_secs) * 1000,
            total,
            buckets as u16,
        )
        .await?;
    anyhow::ensure!(
        r != WarmResult::StockInUse,
        "activity {activity_id}: Redis already holds reservations for SKU {sku_id}; its stock cannot change"
    );
    if let WarmResult::BucketsFixed { warmed } = r {
        anyhow::bail!(
            "activity {activity_id}: Redis holds it in {warmed} stock bucket(s), PostgreSQL in {buckets}"
        );
    }
    info!(activity_id, sku_id, total, buckets, result = ?r, "SKU warmed");
    Ok(r)
}

/// Sets the fair window `args` asks for (its seed made once, both in the activity's audit
/// trail), and returns what the activity holds: `(0, None)` for first come first served.
async fn fair_window(
    settings: &Settings,
    args: &CreateArgs,
    client: &tokio_postgres::Client,
    now: DateTime<Utc>,
) -> anyhow::Result<(i32, Option<String>)> {
    if let Some(ms) = args.fair_window_ms {
        check_fair_window(settings, args, ms)?;
        let seed = format!("fs_{}", ulid::Ulid::new());
        let (ms, seed) = queries::set_fair_window(client, args.activity_id, ms as i32, &seed, now)
            .await?
            .with_context(|| {
                format!(
                    "activity {} has started: its fair window is fixed",
                    args.activity_id
                )
            })?;
        // The seed goes in the activity's audit trail with the window: the draw's order can
        // be recomputed from it.
        let detail = serde_json::json!({"fair_window_ms": ms, "seed": seed});
        let target = format!("activity:{}", args.activity_id);
        let actor = crate::pg::audit::cli_actor();
        crate::pg::audit::record(client, &actor, "fair_window_set", &target, &detail).await?;
    }
    Ok(queries::fair_window(client, args.activity_id)
        .await?
        .unwrap_or((0, None)))
}

/// Sets the pass policy `args` asks for (in the activity's audit trail), and returns whether
/// the activity requires passes.
async fn pass_policy(
    args: &CreateArgs,
    client: &tokio_postgres::Client,
    now: DateTime<Utc>,
) -> anyhow::Result<bool> {
    use crate::pg::passes::{self, PassSpec};
    if let Some(limit) = args.passes {
        let limit = i32::try_from(limit).context("--passes: at most 2147483647")?;
        let pow_difficulty =
            i32::try_from(args.pass_pow_difficulty).context("--pass-pow-difficulty too large")?;
        let spec = PassSpec {
            limit,
            opens_at: args.pass_registration_opens_at,
            closes_at: args.pass_registration_closes_at,
            pow_difficulty,
        };
        if let (Some(o), Some(c)) = (spec.opens_at, spec.closes_at) {
            anyhow::ensure!(
                o < c,
                "--pass-registration-opens-at must be before its close"
            );
        }
        anyhow::ensure!(
            passes::set_policy(client, args.activity_id, &spec, now).await?,
            "activity {}: its passes are fixed once the sale started, and never fewer than issued",
            args.activity_id
        );
        let detail = serde_json::json!({
            "passes": limit,
            "registration_opens_at": spec.opens_at,
            "registration_closes_at": spec.closes_at,
            "pow_difficulty": pow_difficulty,
        });
        let target = format!("activity:{}", args.activity_id);
        let actor = crate::pg::audit::cli_actor();
        crate::pg::audit::record(client, &actor, "passes_set", &target, &detail).await?;
        println!(
            "activity {}: sells to sale-pass holders only, {limit} passes at most",
            args.activity_id
        );
    }
    Ok(matches!(
        passes::policy(client, args.activity_id).await?,
        Some(Some(_))
    ))
}

/// A fair window must fit what a held request can wait, and the sale.
fn check_fair_window(settings: &Settings, args: &CreateArgs, ms: u32) -> anyhow::Result<()> {
    let bound = settings.draw_hold_ms();
    anyhow::ensure!(
        u64::from(ms) <= bound,
        "--fair-window-ms {ms}: at most {bound}, what a request can be held (api.request_timeout_ms \
         less mq.send_timeout_ms and 500 ms)"
    );
    anyhow::ensure!(
        i64::from(ms) < args.duration_secs * 1000,
        "--fair-window-ms {ms}: longer than the sale"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sku_argument() {
        assert_eq!(parse_sku("20001:100"), Ok((20001, 100, 0)));
        assert_eq!(parse_sku("20001:100:999"), Ok((20001, 100, 999)));
        assert!(parse_sku("0:1").is_err());
        assert!(parse_sku("1:-1").is_err());
        assert!(parse_sku("1").is_err());
        assert!(parse_sku("a:b").is_err());
    }
}
