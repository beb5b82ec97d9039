//! The draws nobody waits for, and every draw's record
//! (docs/architecture/hot-path.md#a-fair-start): held requests draw their SKU as soon as its fair
//! window closes; if every one of them went away (clients gone, API instances killed), the scanner
//! draws it once the longest hold is over, winners' first sends due at once so the same pass sends
//! them. Once a SKU's draw is finished (whoever finished it), one scanner records it in the
//! activity's audit trail (`admin_audit`, action `fair_draw`: seed, entrants, winners, losers,
//! when) and its metrics.

use chrono::Utc;
use tracing::info;

use crate::config::Settings;
use crate::redis::{RedisStore, Shard};

/// Draws every SKU of `activity_id` whose fair window closed more than a hold ago (a drawn
/// SKU costs one script call that changes nothing), and records each finished draw once.
pub async fn draw_closed(
    redis: &RedisStore,
    pg: &deadpool_postgres::Pool,
    settings: &Settings,
    activity_id: i64,
) -> anyhow::Result<()> {
    let Some(closes) = redis.draws().fair_window_closes(activity_id).await? else {
        return Ok(());
    };
    let now = Utc::now().timestamp_millis();
    if now < closes {
        return Ok(());
    }
    let backstop = now >= closes + settings.draw_hold_ms() as i64;
    let skus = redis.moves().skus(activity_id).await?;
    for shard in redis.shards(activity_id).await? {
        for &sku_id in &skus {
            if backstop {
                redis
                    .draws()
                    .draw_all(shard, sku_id, now, settings.api.reservation_valid_secs)
                    .await?;
            }
            record(redis, pg, shard, sku_id, closes).await?;
        }
    }
    Ok(())
}

/// The finished draw of `sku_id` in `shard`, in the audit trail and the metrics, once.
async fn record(
    redis: &RedisStore,
    pg: &deadpool_postgres::Pool,
    shard: Shard,
    sku_id: i64,
    closes_ms: i64,
) -> anyhow::Result<()> {
    let Some(r) = redis.draws().take_draw_report(shard, sku_id).await? else {
        return Ok(());
    };
    let detail = serde_json::json!({
        "sku_id": sku_id, "bucket": shard.bucket, "seed": r.seed, "entrants": r.entrants,
        "won": r.won, "lost": r.lost, "window_closed_at_ms": closes_ms,
        "drawn_at_ms": r.drawn_at_ms,
    });
    let target = format!("activity:{}", shard.activity_id);
    let recorded = async {
        let client = pg.get().await?;
        crate::pg::audit::record(&**client, "scan", "fair_draw", &target, &detail).await?;
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = recorded {
        redis.draws().untake_draw_report(shard, sku_id).await?;
        return Err(e);
    }
    metrics::counter!("fair_draw_entrants_total").increment(r.entrants);
    metrics::counter!("fair_draw_won_total").increment(r.won);
    let took = (r.drawn_at_ms - closes_ms).max(0) as f64 / 1000.0;
    metrics::histogram!("fair_draw_seconds").record(took);
    // Per activity and SKU, for the sale's dashboard: each bucket's draw adds its part.
    let labels = [
        ("activity_id", shard.activity_id.to_string()),
        ("sku_id", sku_id.to_string()),
    ];
    metrics::gauge!("fair_draw_entrants", &labels).increment(r.entrants as f64);
    metrics::gauge!("fair_draw_won", &labels).increment(r.won as f64);
    metrics::gauge!("fair_draw_lost", &labels).increment(r.lost as f64);
    metrics::gauge!("fair_draw_duration_seconds", &labels).set(took);
    info!(activity_id = shard.activity_id, sku_id, bucket = shard.bucket, seed = %r.seed,
          entrants = r.entrants, won = r.won, lost = r.lost,
          drawn_in_ms = r.drawn_at_ms - closes_ms, "fair-start draw finished");
    Ok(())
}
