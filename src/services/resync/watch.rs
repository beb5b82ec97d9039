//! The API's watch over the shards it has reserved in
//! (docs/architecture/redis.md#when-redis-forgets): every `every`, each shard's meta is read
//! against the highest (epoch, seq) this process has seen, so a loss is found without waiting for a
//! buyer's request, and a shard whose meta is gone altogether is found at all. A change of the
//! Redis server's run id (a restart, or another server behind the address) is logged and counted,
//! and checked at once.

use std::time::Duration;

use deadpool_redis::redis;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::redis::RedisStore;

/// What one look found wrong with a shard.
fn verdict(
    seen: crate::redis::Mark,
    now: &crate::redis::ShardTrust,
) -> Option<(&'static str, String)> {
    if now.suspect.is_some() || seen.is_zero() {
        return None;
    }
    if !now.present {
        return Some((
            "meta_missing",
            format!(
                "the shard's keys are gone (this process had seen epoch {} seq {})",
                seen.epoch, seen.seq
            ),
        ));
    }
    (now.mark < seen).then(|| {
        (
            "sequence",
            format!(
                "Redis is behind what it answered: epoch {} seq {}, seen epoch {} seq {}",
                now.mark.epoch, now.mark.seq, seen.epoch, seen.seq
            ),
        )
    })
}

/// The server's run id (single server only: a cluster has one per node).
async fn run_id(redis: &RedisStore) -> Option<String> {
    let mut conn = redis.pool.get().await.ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut *conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("run_id:"))
        .map(|s| s.trim().to_string())
}

/// One look at every shard this process has seen.
async fn look(redis: &RedisStore, pg: &deadpool_postgres::Pool, by: &str) -> anyhow::Result<()> {
    let seen = redis.fences().marks().all();
    if seen.is_empty() {
        return Ok(());
    }
    let shards: Vec<_> = seen.iter().map(|(s, _)| *s).collect();
    let trust = redis.fences().shard_trust(&shards).await?;
    for ((shard, mark), now) in seen.iter().zip(&trust) {
        let Some((signal, detail)) = verdict(*mark, now) else {
            continue;
        };
        match super::fence::raise(pg, redis, shard.activity_id, signal, &detail, by).await? {
            Some(_) => {}
            // Nothing to protect (the sale ended long ago): stop watching it.
            None => redis.fences().marks().forget(shard.activity_id),
        }
    }
    Ok(())
}

/// Runs the watch until `stop`.
pub async fn watch_marks(
    redis: RedisStore,
    pg: deadpool_postgres::Pool,
    every: Duration,
    cluster: bool,
    stop: CancellationToken,
) {
    let by = super::fence::actor("api");
    let mut last_run_id: Option<String> = None;
    loop {
        if !cluster {
            if let Some(id) = run_id(&redis).await {
                if last_run_id.as_ref().is_some_and(|l| *l != id) {
                    metrics::counter!("redis_restarts_seen_total").increment(1);
                    warn!(run_id = %id, previous = ?last_run_id,
                          "the Redis server restarted (run id changed): checking every shard");
                }
                last_run_id = Some(id);
            }
        }
        if let Err(e) = look(&redis, &pg, &by).await {
            debug!(error = %format!("{e:#}"), "shard watch failed; next look soon");
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::{Mark, ShardTrust};

    fn trust(epoch: i64, seq: i64) -> ShardTrust {
        ShardTrust {
            present: true,
            mark: Mark { epoch, seq },
            suspect: None,
        }
    }

    #[test]
    fn behind_gone_or_fine() {
        let seen = Mark { epoch: 0, seq: 40 };
        assert_eq!(verdict(seen, &trust(0, 35)).unwrap().0, "sequence");
        assert!(verdict(seen, &trust(0, 40)).is_none());
        assert!(verdict(seen, &trust(2, 1)).is_none(), "a rebuild's epoch");
        assert_eq!(
            verdict(seen, &ShardTrust::default()).unwrap().0,
            "meta_missing"
        );
        let fenced = ShardTrust {
            suspect: Some("x".into()),
            ..trust(0, 1)
        };
        assert!(verdict(seen, &fenced).is_none(), "already fenced");
        assert!(verdict(Mark::default(), &ShardTrust::default()).is_none());
    }
}
