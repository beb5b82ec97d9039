//! The draws nobody waits for (docs/ARCHITECTURE.md#a-fair-start): held requests draw their
//! SKU as soon as its fair window closes; if every one of them went away (clients gone, API
//! instances killed), the scanner draws it once the longest hold is over, and the winners'
//! first sends are due at once, so the same pass sends them.

use chrono::Utc;

use crate::config::Settings;
use crate::redis::RedisStore;

/// Draws every SKU of `activity_id` whose fair window closed more than a hold ago (a drawn
/// SKU costs one script call that changes nothing).
pub async fn draw_closed(
    redis: &RedisStore,
    settings: &Settings,
    activity_id: i64,
) -> anyhow::Result<()> {
    let Some(closes) = redis.fair_window_closes(activity_id).await? else {
        return Ok(());
    };
    let now = Utc::now().timestamp_millis();
    if now < closes + settings.draw_hold_ms() as i64 {
        return Ok(());
    }
    for shard in redis.shards(activity_id).await? {
        for sku_id in redis.skus(activity_id).await? {
            redis
                .draw_all(shard, sku_id, now, settings.api.reservation_valid_secs)
                .await?;
        }
    }
    Ok(())
}
