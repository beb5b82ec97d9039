//! Sale passes in Redis (docs/architecture/hot-path.md#sale-passes): whether an activity sells only
//! to pass holders, kept in every bucket's meta for the reserve script.

use deadpool_redis::redis;

use super::{Passes, Shard, StoreError};

impl Passes<'_> {
    /// Makes the activity sell only to buyers with a pass (or to anyone: `passes` is "0",
    /// which the reserve script reads as no requirement, as it reads no field).
    pub async fn set_passes(&self, activity_id: i64, required: bool) -> Result<(), StoreError> {
        let flag = if required { "1" } else { "0" };
        self.set_on_every_bucket(activity_id, &[("passes", flag.to_string())])
            .await
    }

    /// Writes `fields` to the meta of every stock bucket of the activity (one command per
    /// bucket: on Redis Cluster each is its own hash slot).
    pub(super) async fn set_on_every_bucket(
        &self,
        activity_id: i64,
        fields: &[(&str, String)],
    ) -> Result<(), StoreError> {
        let buckets = self.buckets(activity_id).await?;
        let mut conn = self.pool.get().await?;
        for b in 0..buckets {
            let meta = self.keys.meta(Shard::new(activity_id, b, buckets));
            redis::cmd("HSET")
                .arg(&meta)
                .arg(fields)
                .query_async::<()>(&mut *conn)
                .await?;
        }
        Ok(())
    }

    /// When the activity starts (`None`: not warmed) and whether it requires passes.
    pub async fn passes_required(
        &self,
        activity_id: i64,
    ) -> Result<(Option<i64>, bool), StoreError> {
        let mut conn = self.pool.get().await?;
        let (starts, passes): (Option<i64>, Option<String>) = redis::cmd("HMGET")
            .arg(self.keys.meta(activity_id))
            .arg("starts_at_ms")
            .arg("passes")
            .query_async(&mut *conn)
            .await?;
        Ok((starts, passes.as_deref() == Some("1")))
    }
}
