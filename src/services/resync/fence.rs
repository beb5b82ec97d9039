//! Raising a fence: who acts, what PostgreSQL knows of the activity, and the fence itself on
//! every shard and in PostgreSQL (docs/architecture/redis.md#when-redis-forgets).

use anyhow::Context as _;
use chrono::Utc;
use tracing::warn;

use super::plan::ActivityFacts;
use crate::pg::fences::{self, Fence};
use crate::redis::{RedisStore, RETIRE_AFTER_END_MS};

/// Who is acting, for the fence's record: role, host and process.
pub fn actor(role: &str) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "host".to_string());
    format!("{role}@{host}:{}", std::process::id())
}

/// The activity as PostgreSQL defines it; `None` when it does not know it.
pub async fn activity_facts(
    client: &impl tokio_postgres::GenericClient,
    activity_id: i64,
) -> anyhow::Result<Option<ActivityFacts>> {
    let Some((starts, ends, valid_secs, skus, buckets)) =
        crate::pg::queries::activity(client, activity_id).await?
    else {
        return Ok(None);
    };
    Ok(Some(ActivityFacts {
        activity_id,
        starts_at_ms: starts.timestamp_millis(),
        ends_at_ms: ends.timestamp_millis(),
        valid_ms: i64::from(valid_secs) * 1000,
        skus: skus.into_iter().map(|(s, t)| (s, i64::from(t))).collect(),
        buckets: buckets.max(1) as u16,
        passes_required: matches!(
            crate::pg::passes::policy(client, activity_id).await?,
            Some(Some(_))
        ),
    }))
}

/// Fences the activity: every shard refuses new reservations, and PostgreSQL records the
/// fence (or the one already open is joined). `None` when there is nothing to protect: an
/// activity PostgreSQL does not know, or one that ended long ago (its keys retired).
pub async fn raise(
    pg: &deadpool_postgres::Pool,
    redis: &RedisStore,
    activity_id: i64,
    signal: &'static str,
    detail: &str,
    by: &str,
) -> anyhow::Result<Option<Fence>> {
    let client = pg.get().await?;
    let Some(facts) = activity_facts(&**client, activity_id).await? else {
        return Ok(None);
    };
    let now_ms = Utc::now().timestamp_millis();
    if now_ms > facts.ends_at_ms + RETIRE_AFTER_END_MS {
        return Ok(None);
    }
    // Redis first: the shards stop admitting at once, even if PostgreSQL is slow to answer
    // (the scanner records a fence it finds only in Redis).
    let reason = format!("{signal}: {detail}");
    redis
        .fences()
        .fence(activity_id, facts.buckets, &reason, now_ms)
        .await
        .context("fencing the activity's shards")?;
    let opened = fences::open(&**client, activity_id, signal, detail, by).await?;
    let Some((fence, new)) = opened else {
        return Ok(None);
    };
    if new {
        metrics::counter!("redis_loss_detected_total", "signal" => signal).increment(1);
        warn!(
            activity_id,
            fence_id = fence.fence_id,
            signal,
            detail,
            detected_by = by,
            "Redis lost acknowledged writes: activity fenced until rebuilt from PostgreSQL"
        );
    }
    Ok(Some(fence))
}
