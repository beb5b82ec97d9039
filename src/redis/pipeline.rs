//! Pipelines: one per hash slot on a cluster, sent again while a failover redirects them.

use deadpool_redis::redis;

use super::script::LuaScript;

use super::RedisStore;
use super::StoreError;

/// How often, and how far apart, a pipeline a failover redirected is sent again (at most
/// about a second in all: a replica's promotion takes the cluster's node timeout, 2 s on
/// `scripts/redis-cluster-up.sh`'s nodes, and the slot map follows it).
pub(super) const REDIRECT_RETRIES: u32 = 10;

pub(super) const REDIRECT_RETRY_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// An error a Redis Cluster answers while a slot changes owner.
pub(super) fn redirected(e: &redis::RedisError) -> bool {
    use redis::ErrorKind::*;
    matches!(e.kind(), Moved | Ask | TryAgain | ClusterDown | MasterDown)
}

impl RedisStore {
    /// Runs the calls of one script pipelined, answers in call order: one pipeline per hash slot
    /// (each call's slot given beside it, see [`RedisStore::slot`]: all 0 on one server, so one
    /// round trip), sent side by side. A Redis that lost its script cache (a restart, a promoted replica)
    /// answers NOSCRIPT: the script is loaded and the pipeline sent again; each script here is
    /// idempotent per key.
    pub(super) async fn pipelined<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        calls: &[(u16, redis::ScriptInvocation<'_>)],
    ) -> Result<Vec<T>, StoreError> {
        if calls.is_empty() {
            return Ok(Vec::new());
        }
        let mut by_slot: std::collections::BTreeMap<u16, Vec<usize>> = Default::default();
        for (i, (slot, _)) in calls.iter().enumerate() {
            by_slot.entry(*slot).or_default().push(i);
        }
        let groups: Vec<Vec<usize>> = by_slot.into_values().collect();
        let answers = futures::future::try_join_all(groups.iter().map(|idx| {
            let mut pipe = redis::pipe();
            for &i in idx {
                pipe.invoke_script(&calls[i].1);
            }
            async move { self.run_pipe::<T>(script, &pipe).await }
        }))
        .await?;
        let mut ordered: Vec<Option<T>> = (0..calls.len()).map(|_| None).collect();
        for (idx, group) in groups.iter().zip(answers) {
            for (&i, answer) in idx.iter().zip(group) {
                ordered[i] = Some(answer);
            }
        }
        ordered
            .into_iter()
            .map(|a| a.ok_or_else(|| StoreError::unexpected("a pipelined call got no answer")))
            .collect()
    }

    /// Sends `pipe` (whose scripts are all `script`) in one round trip; on NOSCRIPT, loads the
    /// script and sends it again (every command in these pipelines is idempotent). On a
    /// cluster, a pipeline answered with a redirection or a cluster-down error (a failover
    /// moving its slot: the client follows the new owner once its slot map is refreshed) is
    /// sent again, every [`REDIRECT_RETRY_WAIT`] for at most [`REDIRECT_RETRIES`] times,
    /// counted in `redis_cluster_redirect_retry_total`.
    pub(super) async fn run_pipe<T: redis::FromRedisValue>(
        &self,
        script: &LuaScript,
        pipe: &redis::Pipeline,
    ) -> Result<Vec<T>, StoreError> {
        if pipe.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.pool.get().await?;
        let mut retries = 0;
        loop {
            let err = match pipe.query_async(&mut *conn).await {
                Ok(answers) => return Ok(answers),
                Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                    script
                        .script
                        .prepare_invoke()
                        .load_async(&mut *conn)
                        .await?;
                    match pipe.query_async(&mut *conn).await {
                        Ok(answers) => return Ok(answers),
                        Err(e) => e,
                    }
                }
                Err(e) => e,
            };
            if !(self.cluster && redirected(&err) && retries < REDIRECT_RETRIES) {
                return Err(err.into());
            }
            retries += 1;
            metrics::counter!("redis_cluster_redirect_retry_total").increment(1);
            tokio::time::sleep(REDIRECT_RETRY_WAIT).await;
        }
    }
}
